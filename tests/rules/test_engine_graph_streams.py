"""Streams inside a CUDA graph (issue 50, item 6; docs/ordering-and-rules.md, "CUDA graphs").

A captured graph keeps the streams its work was captured on: a replay is one launch on the replay
stream, and inside it the work of each other captured stream is a branch ordered only by the
events captured with it. The traces model SGLang 0.5.23's dual-stream MoE as its source shows it
(torch.cuda.graph cannot run on CPU, so the events are written by hand, in the order capture writes
them):

  * sglang/srt/models/deepseek_v2.py, `DeepseekV2MoE.forward_normal_dual_stream`:
    `self.alt_stream.wait_stream(current_stream)` (the fork), the routed experts on the current
    stream, the shared experts `with torch.cuda.stream(self.alt_stream)`, then
    `current_stream.wait_stream(self.alt_stream)` (the join) before the two outputs are summed;
  * torch/cuda/streams.py, `Stream.wait_stream`: `self.wait_event(stream.record_event())`: capture
    writes a `record` on the waited stream and a `wait` on the waiting one (the _gpu_trace
    callbacks of CUDAEvent::record and CUDAEvent::block, sanitizer/capture/cuda_hooks.py), during
    a capture as outside one;
  * the decode graphs are replayed on the forward stream, one at a time
    (decode_cuda_graph_runner.py, `replay`).

Before this, a replay put every captured op on the replay stream in capture order and dropped the
captured record/wait: a missing fork or join inside the graph was invisible.
"""
from __future__ import annotations

import pytest

from sanitizer.rules.driver import analyze, compiled_available
from sanitizer.rules.engine import replay_lane
from tracebuilder import Trace

ENGINES = ["interpreted", "compiled"] if compiled_available()[0] else ["interpreted"]

CAP = "cuda:0:s1"       # the capture stream (current_stream inside the capture)
ALT = "cuda:0:s2"       # self.alt_stream
FWD = "cuda:0"          # the forward stream replays run on
HIDDEN, ROUTED, SHARED = 0x1000, 0x9000, 0x11000
KB = 1 << 12


def run(tmp_path, t, engine):
    path = t.write(tmp_path / f"rank0-{engine}.jsonl")
    a = analyze([path], engine=engine, max_per_group=0)
    assert not a.errors, a.errors
    assert a.summary["engine"] == engine
    return a


def dual_stream_moe(t: Trace, *, fork=True, join=True) -> dict:
    """One captured `forward_normal_dual_stream`: the hidden states written on the capture stream,
    the shared experts reading them on the alt stream, the routed experts on the capture stream,
    the sum reading both outputs on the capture stream."""
    lines = {}
    t.ev("graph_begin", graph="g1", stream=CAP, pool="graph-pool:(0, 1)")
    lines["hidden"] = t.launch(CAP, writes=[(HIDDEN, KB)], op="aten::mm")
    if fork:    # self.alt_stream.wait_stream(current_stream)
        t.ev("record", event="e-fork", stream=CAP)
        t.ev("wait", event="e-fork", stream=ALT)
    lines["shared"] = t.launch(ALT, reads=[(HIDDEN, KB)], writes=[(SHARED, KB)], op="shared_experts")
    lines["routed"] = t.launch(CAP, reads=[(HIDDEN, KB)], writes=[(ROUTED, KB)], op="fused_moe")
    if join:    # current_stream.wait_stream(self.alt_stream)
        t.ev("record", event="e-join", stream=ALT)
        t.ev("wait", event="e-join", stream=CAP)
    lines["sum"] = t.launch(CAP, reads=[(ROUTED, KB), (SHARED, KB)], writes=[(ROUTED, KB)], op="aten::add_")
    t.ev("graph_end", graph="g1", stream=CAP)
    return lines


def replays(t: Trace, n=2) -> list:
    out = []
    for step in range(1, n + 1):
        t.ev("step", n=step, phase="decode", tokens=8)
        out.append(t.ev("graph_replay", graph="g1", stream=FWD))
        # the sampler reads the graph's output on the forward stream: ordered after the whole graph
        t.launch(FWD, reads=[(ROUTED, KB)], writes=[(0x20000, KB)], op="sample")
        t.ev("sync")
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_the_forked_and_joined_alt_stream_is_clean_at_every_replay(tmp_path, engine):
    t = Trace()
    dual_stream_moe(t)
    replays(t)
    assert run(tmp_path, t, engine).findings == []


@pytest.mark.parametrize("engine", ENGINES)
def test_a_missing_join_inside_the_graph_is_an_unordered_access_at_replay(tmp_path, engine):
    t = Trace()
    lines = dual_stream_moe(t, join=False)
    replayed = replays(t)
    a = run(tmp_path, t, engine)
    hits = [f for f in a.findings if f.rule == "unordered-access"]
    # the sum on the replay stream reads the shared output the alt lane may still be writing
    assert {f.line for f in hits} == set(replayed), [(f.rule, f.line, f.detail) for f in a.findings]
    assert all(f.op.stream == replay_lane(ALT, FWD) for f in hits)
    assert all(f.overlap == (SHARED, SHARED + KB) for f in hits)
    assert all("aten::add_" in f.detail for f in hits)
    assert {f.step for f in hits} == {1, 2}
    assert lines["shared"] < lines["sum"]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_missing_fork_inside_the_graph_is_an_unordered_access_at_replay(tmp_path, engine):
    t = Trace()
    dual_stream_moe(t, fork=False)
    replayed = replays(t)
    a = run(tmp_path, t, engine)
    hits = [f for f in a.findings if f.rule == "unordered-access"]
    # the shared experts on the alt lane read the hidden states the capture stream writes
    assert {f.line for f in hits} == set(replayed), [(f.rule, f.line, f.detail) for f in a.findings]
    assert all(f.overlap == (HIDDEN, HIDDEN + KB) for f in hits)
    assert all("shared_experts" in f.detail for f in hits)


@pytest.mark.parametrize("engine", ENGINES)
def test_work_before_the_replay_orders_the_alt_lane_and_the_replay_stream_waits_for_it(tmp_path, engine):
    """The graph's first nodes follow the replay stream's earlier work, on every lane; what the
    replay stream does next follows every lane (a graph launch completes as one)."""
    t = Trace()
    dual_stream_moe(t)
    t.launch(FWD, writes=[(HIDDEN, KB)], op="embed")      # before the replay, on its stream
    t.ev("graph_replay", graph="g1", stream=FWD)
    t.launch(FWD, writes=[(SHARED, KB)], op="next_layer")  # after it: the alt lane is joined
    t.ev("sync")
    assert run(tmp_path, t, engine).findings == []


@pytest.mark.parametrize("engine", ENGINES)
def test_another_stream_that_does_not_wait_for_the_replay_still_races_its_lanes(tmp_path, engine):
    t = Trace()
    dual_stream_moe(t)
    line = t.ev("graph_replay", graph="g1", stream=FWD)
    other = t.launch("cuda:0:s7", writes=[(SHARED, KB)], op="kv_copy")   # no wait on the forward stream
    a = run(tmp_path, t, engine)
    hits = [f for f in a.findings if f.rule == "unordered-access"]
    # it races the shared experts' write on the alt lane and the sum's read on the forward stream
    assert {(f.line, f.op.stream, f.op.line) for f in hits} == {(other, replay_lane(ALT, FWD), line), (other, FWD, line)}
