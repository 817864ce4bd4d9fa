"""The GPU kit's graph checks C10-C12 (issue 50): SGLang's graph patterns on a real GPU, one rank.

  C10 shared-pool   two torch.cuda.graph captures into one graph_pool_handle(), largest first, as
                    SGLang captures every decode batch size (model_executor/runner_utils/pool.py,
                    get_or_create_global_graph_memory_pool), each capturing an all-reduce on a
                    temporary freed inside the capture: the second capture takes the first's
                    released bytes (the pool contract: graphs sharing a pool replay one at a time).
                    Expected: clean, at alloc and at full.
  C11 symmetric     SGLang 0.5.23's real pynccl_allocator (SymmetricMemoryContext, its C++ plugin
                    built with load_inline against the device's NCCL) around an einsum with an
                    intermediate: once eagerly, once inside a captured graph (the context pauses
                    the graph pool: the intermediate lands in the NCCL pool), then an eager
                    allocation in the NCCL pool and a replay. EXPECTED_C11 lists the findings.
  C12 alias         a non-owning alias of a captured output, as sgl_kernel.weak_ref_tensor makes
                    one (torch::from_blob: a new StorageImpl over bytes another block owns), made
                    here with torch.as_tensor over __cuda_array_interface__ and with from_dlpack;
                    the owner dropped, the graph replayed, the alias read. Expected: clean.
The expectations are those of the analysis once issue 50's items 1-3 are fixed (pools reserved per
pool, the replay hazard of a window block, aliases not allocations). Each program runs under
HAZSAN=1 in its own interpreter; `hazsan check` judges its trace (judge_* below, tested on CPU).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

from sanitizer.capture.gpu_selfcheck import PRELUDE, _check, _events, child_env

SGLANG_ALLOCATOR = "sglang.srt.distributed.device_communicators.pynccl_allocator"

C10_BODY = '''
    pool = torch.cuda.graph_pool_handle()
    static = torch.ones(N, device="cuda")
    side.wait_stream(compute)
    with torch.cuda.stream(side):                 # warm-up outside capture, as torch recommends
        warm = static * 2
        dist.all_reduce(warm)
        del warm
    compute.wait_stream(side)
    graphs, outs = [], []
    for size in (N, N // 2):                      # largest first, into one pool
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            tmp = static[:size] * 2               # a temporary of this capture
            dist.all_reduce(tmp)
            outs.append(tmp.sum())
            del tmp                               # released inside the capture: the pool's again
        graphs.append(g)
    for _ in range(3):
        for g in graphs:
            g.replay()
    torch.cuda.synchronize()
    del graphs, outs
    torch.cuda.synchronize()
'''

C12_BODY = '''
    static = torch.ones(N, device="cuda")
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        warm = static * 2
        del warm
    compute.wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = static * 2
    class Interface:                              # what weak_ref_tensor's from_blob amounts to:
        pass                                      # a StorageImpl over out's bytes that owns nothing
    view = Interface()
    view.__cuda_array_interface__ = out.__cuda_array_interface__
    alias = torch.as_tensor(view, device="cuda")
    alias_dl = torch.from_dlpack(out)             # a new StorageImpl again (the capsule holds out)
    del out                                       # the owner dropped; the graph's pool keeps the bytes
    total = 0.0
    for _ in range(3):
        static.fill_(1.0)
        g.replay()
        total += float(alias.sum()) + float(alias_dl.sum())
    torch.cuda.synchronize()
    assert total == 3 * 2 * 2.0 * N, total
    del alias, alias_dl
    g.reset()
    torch.cuda.synchronize()
'''

# C11: SGLang's real allocator module, a one-rank NCCL communicator from SGLang's real
# NCCLLibrary (pynccl_wrapper.py), and the attributes SymmetricMemoryContext reads of SGLang's
# GroupCoordinator (pynccl_allocator.py: group_coordinator.pynccl_comm.comm.value, unique_name,
# world_size). get_nccl_mem_pool() calls torch.distributed.barrier(): the prelude's one-rank group.
C11_BODY = '''
    import json, types
    from sanitizer.capture.gpu_selfcheck_graphs import import_sglang_allocator
    from sanitizer.capture.gpu_selfcheck_nccl import import_wrapper
    allocator, how = import_sglang_allocator()
    wrapper, _ = import_wrapper("sglang.srt.distributed.device_communicators.pynccl_wrapper")
    lib = wrapper.NCCLLibrary()
    comm = lib.ncclCommInitRank(1, lib.ncclGetUniqueId(), 0)
    class Coordinator:
        unique_name, world_size, is_first_rank = "tp:kit", 1, True
        pynccl_comm = types.SimpleNamespace(comm=comm, nccl=lib, device=torch.device("cuda:0"))
    tp = Coordinator()
    a, b, c = (torch.randn(64, 64, device="cuda") for _ in range(3))
    def combine_eager():
        return torch.einsum("ij,jk,kl->il", a, b, c)       # C11-EAGER: a@b is an intermediate
    def combine_captured():
        return torch.einsum("ij,jk,kl->il", a, b, c)       # C11-CAPTURED
    with allocator.SymmetricMemoryContext(tp):
        y0 = combine_eager()
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    allocator.set_graph_pool_id(pool)                      # SGLang's runners do this before capture
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        with allocator.SymmetricMemoryContext(tp):
            combine_eager()
    compute.wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        with allocator.SymmetricMemoryContext(tp):          # pauses the graph pool (is_graph_capture)
            y = combine_captured()
        out = y * 2
    with allocator.SymmetricMemoryContext(tp):              # an eager scope after capture (a prefill)
        eager = torch.empty(64 * 64, device="cuda")         # C11-EAGER-ALLOC
        eager.fill_(7.0)
        g.replay()                                          # rewrites the intermediate's bytes
        torch.cuda.synchronize()
        intact = bool((eager == 7.0).all())
    print(json.dumps({"import": how, "eager_intact": intact}))
'''

# Issue 50 items 1-3, as the fixed analysis reports them:
#   transient-in-window:  the captured einsum's intermediate, in a window segment of the NCCL pool
#                         (a replay's collectives run amid it); the eager one, with no collective
#                         in flight or issued during its life, is not one;
#   graph-buffer-released: the eager allocation in the NCCL pool over bytes the live graph's
#                         einsum writes at every replay (item 2), at every level.
EXPECTED_C11 = {
    "transient-in-window": {"site": "C11-CAPTURED", "not_site": "C11-EAGER"},
    "graph-buffer-released": {"site": "C11-EAGER-ALLOC"},
}
LEVELS = ("alloc", "full")


def marker_lines(source: str) -> dict:
    """{marker: line number} of the `# C11-...` markers in a program."""
    out = {}
    for n, line in enumerate(source.splitlines(), 1):
        m = re.search(r"# (C\d+-[A-Z-]+)", line)
        if m:
            out[m.group(1)] = n
    return out


def _at(site: str | None, line: int) -> bool:
    return bool(site) and re.search(rf":{line}(:|$)", site) is not None


def _sites(f: dict) -> list:
    return [s for s in (f.get("site"), (f.get("block") or {}).get("site"), (f.get("op") or {}).get("site")) if s]


def judge_clean(report: dict, events: list, expect_events=(), shared_pool=False) -> list[str]:
    """C10 / C12: no finding, no hook error, the events there; `shared_pool`: every capture in
    one pool, and a capture that took bytes an earlier capture released (the contract exercised)."""
    problems = []
    if "error" in report:
        return ["hazsan check failed: " + str(report["error"])[:800]]
    rules = sorted({f["rule"] for f in report.get("findings", [])})
    if rules:
        problems.append(f"expected clean, got {rules}")
    kinds = {e["ev"] for e in events}
    missing = set(expect_events) - kinds
    if missing:
        problems.append(f"events missing: {sorted(missing)}")
    if any(e["ev"] == "hook_error" for e in events):
        problems.append("hook errors: " + json.dumps([e for e in events if e["ev"] == "hook_error"])[:600])
    if shared_pool:
        problems += _shared_pool(events)
    return problems


def _shared_pool(events: list) -> list[str]:
    pools = [e.get("pool") for e in events if e["ev"] == "graph_begin"]
    if len(pools) != 2 or len(set(pools)) != 1:
        return [f"two captures into one pool expected, graph_begin pools: {pools}"]
    inside, capture, blocks, freed = False, -1, {}, []
    for e in events:
        if e["ev"] == "graph_begin":
            inside, capture = True, capture + 1
        elif e["ev"] == "graph_end":
            inside = False
        elif inside and e["ev"] == "alloc":
            blocks[e["id"]] = (capture, e["addr"], e["addr"] + e["size"])
        elif inside and e["ev"] == "free" and e["id"] in blocks and blocks[e["id"]][0] == 0:
            freed.append(blocks[e["id"]])
    later = [b for b in blocks.values() if b[0] == 1]
    if not any(lo < fhi and flo < hi for _, lo, hi in later for _, flo, fhi in freed):
        return ["the second capture took none of the bytes the first released: the shared pool was not exercised"]
    return []


def judge_c11(reports: dict, source: str) -> list[str]:
    """C11: at each level, every expected rule found at its site (and not at `not_site`)."""
    lines = marker_lines(source)
    problems = []
    for level in LEVELS:
        report = reports.get(level)
        if report is None or "error" in report:
            problems.append(f"{level}: hazsan check failed: {str((report or {}).get('error'))[:500]}")
            continue
        findings = report.get("findings", [])
        for rule, where in EXPECTED_C11.items():
            mine = [f for f in findings if f["rule"] == rule]
            if not any(_at(s, lines[where["site"]]) for f in mine for s in _sites(f)):
                problems.append(f"{level}: no {rule} at {where['site']} (line {lines[where['site']]}); "
                                f"got {[(f['rule'], _sites(f)) for f in findings][:6]}")
            if "not_site" in where and any(_at(s, lines[where["not_site"]]) for f in mine for s in _sites(f)):
                problems.append(f"{level}: {rule} at {where['not_site']}, which is not the hazard")
        unexpected = sorted({f["rule"] for f in findings} - set(EXPECTED_C11))
        if unexpected:
            problems.append(f"{level}: unexpected rules {unexpected}")
    return problems


def import_sglang_allocator():
    """SGLang's real pynccl_allocator module, and how it was imported.

    Its own imports (pynccl_allocator.py, lines 18-21 in 0.5.23): GroupCoordinator (a type
    annotation only: the module has `from __future__ import annotations`), `envs` (two flags read
    by the debug check and the prealloc), `get_exec` (is_symmetric_memory_enabled) and
    `torch_release`. On a GPU image with SGLang installed without its dependencies (the kit:
    `pip install --no-deps sglang`) the server modules behind them do not import; then those four
    names come from stand-ins and the parent packages are made empty packages over their installed
    folders, and the file itself, SGLang's, is imported by the import system under its own name (so
    capture's post-import hook patches it as in a server)."""
    import importlib
    import types
    try:
        return importlib.import_module(SGLANG_ALLOCATOR), "package"
    except ImportError as first:
        reason = f"{type(first).__name__}: {first}"
    import torch
    from sanitizer.capture.gpu_selfcheck_nccl import import_wrapper
    for name in [n for n in list(sys.modules) if n == "sglang" or n.startswith("sglang.")]:
        if sys.modules[name] is None or not hasattr(sys.modules[name], "__path__"):
            sys.modules.pop(name)      # half-imported leaves of the failed attempt

    def leaf(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m

    class Flag:
        def __init__(self, value):
            self.value = value

        def get(self):
            return self.value

    class GroupCoordinator:            # annotation only in pynccl_allocator.py
        pass

    exec_ctx = types.SimpleNamespace(comm=types.SimpleNamespace(enable_symm_mem=True))
    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    # parents as empty packages first (import_wrapper makes them over the installed folders)
    import_wrapper("sglang.srt.distributed.device_communicators.pynccl_wrapper")
    leaf("sglang.srt.distributed.parallel_state", GroupCoordinator=GroupCoordinator,
         get_tp_group=lambda: None)
    leaf("sglang.srt.environ", envs=types.SimpleNamespace(SGLANG_DEBUG_SYMM_MEM=Flag(False),
                                                          SGLANG_SYMM_MEM_PREALLOC_GB_SIZE=Flag(0)))
    leaf("sglang.srt.runtime_context", get_exec=lambda: exec_ctx)
    leaf("sglang.srt.utils.common", torch_release=version)
    return importlib.import_module(SGLANG_ALLOCATOR), f"file with stand-ins for its imports ({reason})"[:300]


def program(body: str) -> str:
    return PRELUDE + textwrap.dedent(body)


def _run(source: str, level: str, directory: str, store: str, timeout: float = 240.0, **extra):
    env = child_env(level, directory, SELFCHECK_STORE=store, **extra)
    return subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=timeout)


def clean_check(name: str, body: str, work: str, expect_events, shared_pool=False) -> dict:
    """C10 / C12 at both levels."""
    source = program(body)
    figures, problems = {}, []
    for level in LEVELS:
        directory = os.path.join(work, f"{name}-{level}")
        run = _run(source, level, directory, os.path.join(work, f"{name}-{level}.store"))
        if run.returncode != 0:
            problems.append(f"{level}: program failed (exit {run.returncode}): {run.stderr[-1200:]}")
            continue
        _, report = _check(directory)
        evs = _events(directory)
        figures[level] = {"rules": sorted({f["rule"] for f in report.get("findings", [])}), "events": len(evs)}
        problems += [f"{level}: {p}" for p in judge_clean(report, evs, expect_events, shared_pool)]
    return {"status": "fail" if problems else "pass", "reason": "; ".join(problems), "figures": figures,
            "traces": work}


def c10(work: str) -> dict:
    return clean_check("shared-pool", C10_BODY, work, {"graph_begin", "graph_end", "graph_replay", "coll"},
                       shared_pool=True)


def c12(work: str) -> dict:
    return clean_check("alias", C12_BODY, work, {"graph_begin", "graph_end", "graph_replay", "graph_free"})


def nccl_link_dir(work: str) -> str | None:
    """A folder with `libnccl.so` for the plugin's `-lnccl`: pip's NCCL (nvidia-nccl-cu13) ships
    only libnccl.so.2, which the linker does not take for -lnccl."""
    try:
        import nvidia.nccl
        lib = os.path.join(list(nvidia.nccl.__path__)[0], "lib")
    except Exception:
        return None
    real = os.path.join(lib, "libnccl.so.2")
    if not os.path.exists(real):
        return None
    d = os.path.join(work, "nccl-link")
    os.makedirs(d, exist_ok=True)
    if not os.path.exists(os.path.join(d, "libnccl.so")):
        os.symlink(real, os.path.join(d, "libnccl.so"))
    return d


def c11(work: str) -> dict:
    try:
        import_sglang_allocator()
    except Exception as exc:
        return {"status": "skip", "reason": f"SGLang's pynccl_allocator is not importable: {exc}"[:500]}
    source = program(C11_BODY)
    extra = {"NCCL_CUMEM_ENABLE": "1", "TMPDIR": os.path.join(work, "tmp")}
    os.makedirs(extra["TMPDIR"], exist_ok=True)
    link = nccl_link_dir(work)
    if link:
        extra["LIBRARY_PATH"] = os.pathsep.join(p for p in (link, os.environ.get("LIBRARY_PATH")) if p)
    reports, figures = {}, {}
    for level in LEVELS:
        directory = os.path.join(work, f"symmetric-{level}")
        run = _run(source, level, directory, os.path.join(work, f"symmetric-{level}.store"), timeout=300, **extra)
        if run.returncode != 0:
            text = run.stderr[-1500:]
            if "load_inline" in text or "ninja" in text.lower() or "-lnccl" in text:
                return {"status": "skip", "reason": f"SGLang's NCCL allocator plugin did not build here: {text}"}
            return {"status": "fail", "reason": f"{level}: program failed (exit {run.returncode}): {text}",
                    "traces": work}
        out = json.loads(run.stdout.strip().splitlines()[-1])
        _, reports[level] = _check(directory)
        figures[level] = {**out, "rules": sorted({f["rule"] for f in reports[level].get("findings", [])})}
    problems = judge_c11(reports, source)
    return {"status": "fail" if problems else "pass", "reason": "; ".join(problems), "figures": figures,
            "traces": work}

