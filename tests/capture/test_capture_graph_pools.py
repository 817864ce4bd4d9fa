"""CUDA graph pools in capture (sanitizer/capture/cuda_hooks.py, `graph_begin` / `graph_end`), on CPU.

Graphs given one pool share it, and the engine reserves their buffers per pool (issue 50, item 1),
so capture must give every graph of one pool the same pool name. torch offers two ways to share:
  * a handle from `torch.cuda.graph_pool_handle()`, passed to every capture: what SGLang 0.5.23
    does (runner_utils/pool.py `get_or_create_global_graph_memory_pool`, used by
    full_cuda_graph_backend.py `capture_one` as `torch.cuda.graph(cuda_graph=graph, pool=self._pool,
    stream=...)`, whose `__enter__` calls `capture_begin(*self.pool)`, torch/cuda/graphs.py);
  * another graph's `pool()`, documented by torch's CUDAGraph.capture_begin ("Token (returned by
    graph_pool_handle() or other_Graph_instance.pool())"); CUDAGraph::pool() answers only once
    that graph's capture ended (aten/src/ATen/cuda/CUDAGraph.cpp).
A real HAZSAN=1 interpreter runs torch.cuda.CUDAGraph's own Python methods on a subclass whose base
stands in for the C++ binding (absent from a CPU build), as tests/capture/test_capture_cuda.py does;
its `pool()` returns what c10 would: the handle it was given, else a fresh private id (n, 0)
(MempoolId_t from graph_pool_handle(false)). torch.cuda.graph itself cannot run here (its
`__enter__` synchronises CUDA), so the program calls capture_begin as that `__enter__` does.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.usefixtures("jsonl_capture")

pytest.importorskip("torch")

PROGRAM = textwrap.dedent(r'''
    import itertools
    import torch
    import sanitizer

    _private = itertools.count(1)

    class GraphBinding:
        """Stands in for torch._C._CUDAGraph: capture_begin keeps the pool id it is given, or makes
        the graph's own (c10: MempoolId_t {uid++, 0}); pool() answers after capture_end only."""
        def capture_begin(self, pool=None, capture_error_mode="global"):
            self._id = tuple(pool) if pool is not None else (next(_private), 0)
            self._ended = False
        def capture_end(self):
            self._ended = True
        def pool(self):
            if not self._ended:
                raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
            return self._id
        def replay(self):
            pass
        def reset(self):
            pass

    class Graph(torch.cuda.CUDAGraph, GraphBinding):
        def __new__(cls, keep_graph=False):   # CUDAGraph.__new__ without its C++ base
            g = object.__new__(cls)
            g._tracker = None
            return g
        def __init__(self, *a, **k):
            pass

    def capture(graph, *pool):
        # torch.cuda.graph.__enter__ / __exit__, less the CUDA stream and synchronize
        graph.capture_begin(*pool, capture_error_mode="global")
        graph.capture_end()
        return graph

    handle = (0, 7)       # torch.cuda.graph_pool_handle(): MempoolId_t {0, uuid}
    sanitizer.step(1)     # SGLang: every decode shape into the one handle, largest first
    bs8 = capture(Graph(), handle)
    bs4 = capture(Graph(), handle)
    sanitizer.step(2)     # a graph's own pool, then shared through its pool()
    own = capture(Graph())
    after = capture(Graph(), own.pool())
    sanitizer.step(3)     # a graph of its own, sharing nothing
    alone = capture(Graph())
    for g in (bs8, bs4, own, after, alone):
        g.replay()
    sanitizer.step(4)
''')


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("pools")
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(tmp_path / "traces"), HAZSAN_LEVEL="alloc")
    for k in ("RANK", "LOCAL_RANK"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, str(prog)], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (path,) = list((tmp_path / "traces").iterdir())
    return path, [json.loads(line) for line in path.read_bytes().splitlines()[1:]]


def test_graphs_given_one_handle_or_a_graphs_pool_name_one_pool(trace):
    _, events = trace
    assert [e for e in events if e["ev"] == "hook_error"] == []
    begins = {e["graph"]: e["pool"] for e in events if e["ev"] == "graph_begin"}
    assert begins == {
        "g1": "graph-pool:(0, 7)", "g2": "graph-pool:(0, 7)",    # the one graph_pool_handle()
        "g3": "graph:g3", "g4": "graph:g3",                       # g4 = capture_begin(pool=g3.pool())
        "g5": "graph:g5",                                          # its own
    }


def test_the_trace_checks_clean(trace):
    from sanitizer.rules.driver import analyze

    path, _ = trace
    a = analyze([path])
    assert not a.errors and a.findings == []
