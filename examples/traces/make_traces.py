"""Writes the example traces in this folder: one clean decode step, and one per rule.

Each scenario is a few decode layers of a tensor-parallel model as a serving stack records it
(schema 1, docs/trace-format.md): a compute stream (7), a communication stream (9), an NCCL
symmetric window for communicator "tp", and the ordering edges between them. Regenerate with
`python examples/traces/make_traces.py`; `examples/demo.py --traces-only` checks that each file gives exactly
the findings its name says.
"""
from __future__ import annotations

from pathlib import Path

import orjson

HERE = Path(__file__).parent
WIN = 0x7F3A_0000_0000  # the symmetric window (ncclMemAlloc'd pool segment)
HEAP = 0x7F20_0000_0000  # default pool
H = 7168 * 2 * 16  # one [16 tokens, 7168] bf16 activation


class Rank:
    def __init__(self, name: str, rank: int = 0, world: int = 1):
        self.path = HERE / name
        self.events = [{"hazsan": 1, "rank": rank, "world_size": world, "device": f"cuda:{rank}"}]
        self.ids = 0
        self.cid = 0
        self.seq = 0

    def ev(self, kind, **f):
        self.events.append({"ev": kind, **f})

    def alloc(self, addr, size, site, stream=7, pool="default", op="aten::empty"):
        self.ids += 1
        self.ev("alloc", id=self.ids, addr=addr, size=size, stream=stream, pool=pool, site=site, op=op,
                stack=[site, "sglang/srt/models/deepseek_v4.py:2210:forward", "sglang/srt/model_executor/model_runner.py:1810:forward_decode"])
        return self.ids

    def all_reduce(self, addr, size, stream=9, site="sglang/srt/distributed/communication_op.py:14:tensor_model_parallel_all_reduce"):
        self.cid += 1
        self.seq += 1
        self.ev("coll", cid=self.cid, comm="tp", seq=self.seq, op="all_reduce", stream=stream, site=site,
                bufs=[{"addr": addr, "size": size, "access": "rw"}])
        return self.cid

    def handshake_to_comm(self, e):
        self.ev("record", event=e, stream=7)
        self.ev("wait", event=e, stream=9)

    def handshake_back(self, e):
        self.ev("record", event=e, stream=9)
        self.ev("wait", event=e, stream=7)

    def write(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in self.events))


def layer_ok(t: Rank, layer: int, step: int):
    """One row-parallel layer done right: output allocated in the window inside the scope,
    computed on 7, handed to 9 with an event, all-reduced, handed back, freed after the wait."""
    x = t.alloc(HEAP + layer * H, H, "sglang/srt/layers/linear.py:1402:forward", op="aten::mm")
    t.ev("launch", stream=7, op="aten::mm", writes=[[HEAP + layer * H, H]], site="sglang/srt/layers/linear.py:1402:forward")
    t.ev("scope", name="symm", enter=True, pool="symm", comm="tp")
    out = t.alloc(WIN, H, "sglang/srt/layers/linear.py:1420:forward", pool="symm")
    t.ev("scope", name="symm", enter=False, pool="symm", comm="tp")
    t.ev("launch", stream=7, op="aten::copy_", reads=[[HEAP + layer * H, H]], writes=[[WIN, H]])
    t.handshake_to_comm(f"e{step}.{layer}")
    t.all_reduce(WIN, H)
    t.handshake_back(f"f{step}.{layer}")
    t.ev("launch", stream=7, op="aten::add", reads=[[WIN, H]], writes=[[HEAP + layer * H, H]])
    t.ev("free", id=out)
    t.ev("free", id=x)


def window(t: Rank):
    t.ev("segment", addr=WIN, size=64 << 20, pool="symm")
    t.ev("window", addr=WIN, size=64 << 20, comm="tp")


def clean():
    t = Rank("clean.jsonl")
    window(t)
    for step in range(2):
        t.ev("step", n=step, tokens=16)
        for layer in range(3):
            layer_ok(t, layer, step)
        # a buffer consumed on the comm stream, freed safely with record_stream
        b = t.alloc(HEAP + 8 * H, H, "sglang/srt/layers/moe/ep_moe.py:300:dispatch")
        t.ev("launch", stream=7, writes=[[HEAP + 8 * H, H]])
        t.handshake_to_comm(f"g{step}")
        t.ev("launch", stream=9, op="deep_ep::dispatch", reads=[[HEAP + 8 * H, H]])
        t.ev("record_stream", id=b, stream=9)
        t.ev("free", id=b)
        t.ev("sync", stream=7)
        t.ev("free_done", id=b)
    # a CUDA graph whose static buffers stay alive while it lives
    g_in = t.alloc(HEAP + 16 * H, H, "sglang/srt/model_executor/cuda_graph_runner.py:600:capture", pool="graph")
    t.ev("graph_begin", graph=1, stream=7)
    t.ev("launch", stream=7, op="aten::mm", reads=[[HEAP + 16 * H, H]], writes=[[HEAP + 16 * H, H]])
    t.ev("graph_end", graph=1, stream=7)
    t.ev("launch", stream=7, op="aten::copy_", writes=[[HEAP + 16 * H, H]])
    t.ev("graph_replay", graph=1, stream=7)
    t.ev("sync")
    t.ev("graph_free", graph=1)
    t.ev("free", id=g_in)
    t.write()


def reuse_in_flight():
    """The reference fault: the all-reduce output is dropped before the wait, and the einsum
    transient of the next mHC combine lands on it while the collective still runs."""
    t = Rank("reuse-in-flight.jsonl")
    window(t)
    t.ev("step", n=0, tokens=16)
    t.ev("scope", name="symm", enter=True, pool="symm", comm="tp")
    out = t.alloc(WIN, H, "sglang/srt/layers/linear.py:1420:forward", pool="symm")
    t.ev("scope", name="symm", enter=False, pool="symm", comm="tp")
    t.ev("launch", stream=7, writes=[[WIN, H]])
    t.handshake_to_comm("e0")
    t.all_reduce(WIN, H)
    t.ev("free", id=out)  # no record_stream, no wait: the block goes back to the pool
    t.ev("scope", name="symm", enter=True, pool="symm", comm="tp")
    tmp = t.alloc(WIN, 4 * H, "sglang/srt/layers/mhc.py:2743:mhc_combine", pool="symm", op="aten::einsum")
    t.ev("launch", stream=7, op="aten::bmm", writes=[[WIN, 4 * H]])
    t.ev("scope", name="symm", enter=False, pool="symm", comm="tp")
    t.handshake_back("f0")
    t.ev("free", id=tmp)
    t.write()


def free_in_flight():
    """The latent cause alone: freed before the wait, nothing happens to land there (yet)."""
    t = Rank("free-in-flight.jsonl")
    window(t)
    t.ev("step", n=0, tokens=16)
    out = t.alloc(WIN, H, "sglang/srt/layers/linear.py:1420:forward", pool="symm")
    t.ev("launch", stream=7, writes=[[WIN, H]])
    t.handshake_to_comm("e0")
    t.all_reduce(WIN, H)
    t.ev("free", id=out)
    t.handshake_back("f0")
    t.write()


def transient_in_window():
    """The einsum of the stock mHC combine runs inside the symmetric scope: its float32
    transients are placed in the window, although no collective ever uses them."""
    t = Rank("transient-in-window.jsonl")
    window(t)
    for step in range(3):
        t.ev("step", n=step, tokens=16)
        t.ev("scope", name="symm", enter=True, pool="symm", comm="tp")
        y = t.alloc(WIN, H, "sglang/srt/layers/mhc.py:2741:mhc_combine", pool="symm")
        tmp = t.alloc(WIN + H, 8 * H, "sglang/srt/layers/mhc.py:2743:mhc_combine", pool="symm", op="aten::einsum")
        t.ev("launch", stream=7, op="aten::bmm", writes=[[WIN + H, 8 * H]])
        t.ev("launch", stream=7, op="aten::sum", reads=[[WIN + H, 8 * H]], writes=[[WIN, H]])
        t.ev("free", id=tmp)
        t.ev("scope", name="symm", enter=False, pool="symm", comm="tp")
        t.all_reduce(WIN, H, stream=7)
        t.ev("launch", stream=7, reads=[[WIN, H]])
        t.ev("free", id=y)
    t.write()


def unordered_access():
    """The result of an asynchronous all-reduce is read without waiting for it."""
    t = Rank("unordered-access.jsonl")
    window(t)
    t.ev("step", n=0, tokens=16)
    out = t.alloc(WIN, H, "sglang/srt/layers/linear.py:1420:forward", pool="symm")
    t.ev("launch", stream=7, writes=[[WIN, H]])
    t.handshake_to_comm("e0")
    t.all_reduce(WIN, H)
    t.ev("launch", stream=7, op="aten::add", reads=[[WIN, H]], site="sglang/srt/models/deepseek_v4.py:2230:forward")
    t.handshake_back("f0")
    t.ev("free", id=out)
    t.write()


def graph_buffer_released():
    """A captured all-reduce's buffer is released while the graph is still replayed."""
    t = Rank("graph-buffer-released.jsonl")
    window(t)
    buf = t.alloc(WIN, H, "sglang/srt/model_executor/cuda_graph_runner.py:610:capture_one_batch_size", pool="symm")
    t.ev("graph_begin", graph=3, stream=7)
    t.ev("launch", stream=7, op="aten::mm", writes=[[WIN, H]])
    t.all_reduce(WIN, H, stream=7)
    t.ev("graph_end", graph=3, stream=7)
    t.ev("graph_replay", graph=3, stream=7)
    t.ev("sync")
    t.ev("free", id=buf)  # Python dropped the static buffer; the graph still writes it
    t.ev("graph_replay", graph=3, stream=7)
    t.ev("sync")
    t.ev("graph_free", graph=3)
    t.write()


def asymmetric_offset():
    """Rank 1 allocates a small extra block in the window first, so every later offset shifts."""
    for rank in range(2):
        t = Rank(f"asymmetric-offset/rank{rank}.jsonl", rank=rank, world=2)
        window(t)
        t.ev("step", n=0, tokens=16)
        base = WIN
        if rank == 1:
            t.alloc(WIN, 512, "sglang/srt/layers/dp_attention.py:88:debug_probe", pool="symm")
            base = WIN + 512
        out = t.alloc(base, H, "sglang/srt/layers/linear.py:1420:forward", pool="symm")
        t.ev("launch", stream=7, writes=[[base, H]])
        t.all_reduce(base, H, stream=7)
        t.ev("launch", stream=7, reads=[[base, H]])
        t.ev("free", id=out)
        t.write()


SCENARIOS = {
    "clean.jsonl": (clean, set()),
    "reuse-in-flight.jsonl": (reuse_in_flight, {"reuse-in-flight", "free-in-flight", "unordered-access", "transient-in-window"}),
    "free-in-flight.jsonl": (free_in_flight, {"free-in-flight"}),
    "transient-in-window.jsonl": (transient_in_window, {"transient-in-window"}),
    "unordered-access.jsonl": (unordered_access, {"unordered-access"}),
    "graph-buffer-released.jsonl": (graph_buffer_released, {"graph-buffer-released"}),
    "asymmetric-offset": (asymmetric_offset, {"asymmetric-offset"}),
}

if __name__ == "__main__":
    for name, (make, _) in SCENARIOS.items():
        make()
        print("wrote", HERE / name)
