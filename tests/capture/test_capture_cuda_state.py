"""No CUDA side effects (sanitizer/capture/cuda_state.py, facts.py, allocator_history.install).

Capture must never initialise CUDA in a process that has not: a CUDA context in a parent makes
every forked child unable to use CUDA, and servers choose fork or spawn by asking
`torch.cuda.is_initialized()`. This machine has no GPU, so the checks are the only ones possible
without one:
  * spies (tests/support/cuda_spy.py) on every torch.cuda device query and the torch._C functions under
    them, installed before capture's hooks, count the calls of a real HAZSAN=1 program (gloo
    process group, collectives, steps, a symmetric scope, exit), at both levels and both
    allocation sources, on this CPU build and on it faked to look built with CUDA: none may come;
  * "CUDA initialised" is faked (is_initialized() answers True) to see the header take the
    current device, and a fake `pynvml` module stands in for NVML.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jsonl_capture")

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")

PROGRAM = textwrap.dedent(r'''
    import os, sys, tempfile
    sys.path.insert(0, os.environ["SPY_TESTS"])
    import cuda_spy                 # before torch: the spies are in place before capture's hooks
    import torch
    import torch.distributed as dist
    import sanitizer

    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{store}")
    x = torch.ones(64)
    dist.all_reduce(x)
    y = x * 2 + 1
    sanitizer.step(1)
    with sanitizer.symmetric_scope(dist.group.WORLD, pool="symm"):
        z = torch.empty(128)
        dist.all_reduce(z, async_op=True).wait()
    dist.barrier()
    sanitizer.step(2)
    if sanitizer.enabled():
        from sanitizer.capture import runtime
        cap = runtime._active
        cuda_spy.note("header", facts=cap.header_facts())
        cuda_spy.note("queued", calls=[f"{getattr(c, '__module__', '')}.{getattr(c, '__qualname__', '')}"
                                       for c, _ in torch.cuda._queued_calls])
        hist = getattr(cap, "alloc_history", None)
        cuda_spy.note("history", enabled=None if hist is None else hist.enabled)
    if os.environ.get("SPY_PROGRAM_QUERIES") == "1":      # the control: the program asks itself
        torch.cuda.is_available()
    dist.destroy_process_group()
    del x, y, z
''')

HEADER_PROGRAM = textwrap.dedent(r'''
    import os, sys
    sys.path.insert(0, os.environ["SPY_TESTS"])
    import cuda_spy
    import torch
    import sanitizer
    x = torch.ones(8) * 2
    sanitizer.step(1)
    from sanitizer.capture import runtime
    cuda_spy.note("header", facts=runtime._active.header_facts())
''')


def run(tmp_path, program=PROGRAM, capture=True, **env_extra):
    out = tmp_path / "spy.jsonl"
    traces = tmp_path / "traces"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HAZSAN", "SPY_", "CUDA_VISIBLE_DEVICES"))}
    env.update(SPY_OUT=str(out), SPY_TESTS=HERE, HAZSAN="1" if capture else "0", HAZSAN_DIR=str(traces),
               HAZSAN_TRACE_FORMAT="jsonl")
    env.update({k: str(v) for k, v in env_extra.items()})
    prog = tmp_path / "prog.py"
    prog.write_text(program)
    p = subprocess.run([sys.executable, str(prog)], env=env, capture_output=True, text=True,
                       timeout=180, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-4000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    headers = []
    if traces.is_dir():
        for f in sorted(traces.iterdir()):
            if f.name.endswith(".jsonl"):
                lines = f.read_text().splitlines()
                headers.append(json.loads(lines[0]))
                evs = [json.loads(x) for x in lines[1:]]
                assert not [e for e in evs if e["ev"] == "hook_error"], evs
                assert evs and evs[-1]["ev"] == "end", f.name       # a clean close
    return records, headers, p


def calls(records):
    return [r for r in records if r["kind"] == "call"]


def describe(records) -> str:
    return "\n".join(f"{c['name']} from:\n{c['stack']}" for c in calls(records))


def one(records, kind):
    found = [r for r in records if r["kind"] == kind]
    assert len(found) == 1, (kind, records)
    return found[0]


# ---------------------------------------------------------------------- the spies see
@pytest.mark.parametrize("fake_build", ["0", "1"])
def test_control_the_spies_see_a_query_and_the_bare_program_makes_none(tmp_path, fake_build):
    """The program's own torch.cuda.is_available() is seen, so the spies are live; without that
    call (and without capture) nothing is: every call counted under capture is capture's."""
    records, _, _ = run(tmp_path, capture=False, SPY_FAKE_BUILD=fake_build, SPY_PROGRAM_QUERIES="1")
    assert one(records, "spies")["hooks_before"] is None
    assert [c["name"] for c in calls(records)] == ["torch.cuda.is_available"]
    (tmp_path / "spy.jsonl").unlink()
    records, _, _ = run(tmp_path, capture=False, SPY_FAKE_BUILD=fake_build)
    assert calls(records) == [], describe(records)


@pytest.mark.parametrize("level,source,fake_build", [
    ("alloc", "dispatch", "1"),
    ("full", "dispatch", "1"),
    ("alloc", "history", "1"),
    ("full", "history", "1"),
    ("full", "history", "0"),          # this CPU build as it is
    ("alloc", "native", "0"),          # the native recorder (HAZSAN_NATIVE=1) on this CPU build
])
def test_capture_makes_no_cuda_query(tmp_path, level, source, fake_build):
    if source == "native":
        from gloo_programs import require_native
        require_native()
    records, headers, _ = run(tmp_path, HAZSAN_LEVEL=level,
                              HAZSAN_ALLOC_SOURCE="dispatch" if source == "native" else source,
                              HAZSAN_NATIVE="1" if source == "native" else "0", SPY_FAKE_BUILD=fake_build)
    assert one(records, "spies")["hooks_before"] == []      # spied before capture hooked torch
    assert calls(records) == [], describe(records)
    facts = one(records, "header")["facts"]
    path = "native-recorder" if source == "native" else "dispatch-mode"
    assert path in facts["hooks"]["installed"] and "collectives" in facts["hooks"]["installed"]
    assert facts["gpu"] is None                 # no NVML here, CUDA never initialised: nothing known
    assert headers and all(h.get("gpu") is None for h in headers)
    queued = one(records, "queued")["calls"]
    started = [c for c in queued if c.startswith("sanitizer.")]
    if source == "history" and fake_build == "1":
        # a CUDA build: recording waits in torch's lazy-init queue, and stays there
        assert "allocator-history" in facts["hooks"]["installed"]
        assert started == ["sanitizer.capture.allocator_history.install.<locals>.start"]
        assert one(records, "history")["enabled"] is False
    else:
        assert "allocator-history" not in facts["hooks"]["installed"] and started == []


def test_control_under_capture_the_programs_own_query_is_seen(tmp_path):
    """With capture's hooks in place the spies still see a query (the program's own): capture
    neither hides nor replaces them. (Run against the code before this change, the same spies
    caught the header's and the history source's is_available().)"""
    records, _, _ = run(tmp_path, SPY_FAKE_BUILD="1", SPY_PROGRAM_QUERIES="1")
    assert [c["name"] for c in calls(records)] == ["torch.cuda.is_available"]
    assert "prog.py" in calls(records)[0]["stack"]


# ---------------------------------------------------------------------- the header's device facts
def test_header_from_nvml_before_cuda_is_initialised(tmp_path):
    # two different models: NVML's first is CUDA's first only in PCI bus order
    records, headers, _ = run(tmp_path, program=HEADER_PROGRAM, SPY_FAKE_BUILD="1", SPY_FAKE_PYNVML="1",
                              CUDA_DEVICE_ORDER="PCI_BUS_ID")
    assert calls(records) == [], describe(records)
    gpu = one(records, "header")["facts"]["gpu"]
    assert gpu == {"count": 2, "name": "NVIDIA H200", "capability": "SM90", "driver": "570.86.15",
                   "cuda": torch.version.cuda}
    assert "device" not in gpu                  # no current device before CUDA is initialised
    assert headers and headers[0]["gpu"] == gpu
    nvml = [r["name"] for r in records if r["kind"] == "nvml"]
    assert nvml.count("nvmlInit") == nvml.count("nvmlShutdown") >= 1


def test_header_takes_the_current_device_once_cuda_is_initialised(tmp_path):
    records, headers, _ = run(tmp_path, program=HEADER_PROGRAM, SPY_FAKE_BUILD="1",
                              SPY_FAKE_INITIALIZED="1", SPY_FAKE_PYNVML="1")
    asked = {c["name"] for c in calls(records)}
    # initialised: torch answers for its current device; nothing initialises again
    assert asked <= {"torch.cuda.current_device", "torch.cuda.get_device_name",
                     "torch.cuda.get_device_capability", "torch.cuda.device_count"}, describe(records)
    assert "torch.cuda.current_device" in asked
    gpu = one(records, "header")["facts"]["gpu"]
    assert gpu == {"device": 3, "count": 4, "name": "Torch Fake GPU", "capability": "SM90",
                   "driver": "570.86.15", "cuda": torch.version.cuda}
    assert headers and headers[0]["gpu"]["device"] == 3


def test_header_without_pynvml_after_initialisation(tmp_path):
    records, _, _ = run(tmp_path, program=HEADER_PROGRAM, SPY_FAKE_BUILD="1", SPY_FAKE_INITIALIZED="1")
    gpu = one(records, "header")["facts"]["gpu"]
    assert gpu == {"device": 3, "count": 4, "name": "Torch Fake GPU", "capability": "SM90",
                   "cuda": torch.version.cuda}


# ---------------------------------------------------------------------- in-process units
class FakeNvml(types.ModuleType):
    def __init__(self, devices, fail_init=False):
        super().__init__("pynvml")
        self.devices, self.fail_init, self.log = devices, fail_init, []

    def nvmlInit(self):
        self.log.append("init")
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.log.append("shutdown")

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.devices[i]

    def nvmlDeviceGetName(self, h):
        return h[0].encode()               # older pynvml: bytes

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return h[1]

    def nvmlDeviceGetUUID(self, h):
        return h[2]

    def nvmlSystemGetDriverVersion(self):
        return "580.1"


DEVICES = [("A100", (8, 0), "GPU-aa11"), ("H200", (9, 0), "GPU-bb22"), ("L4", (8, 9), "GPU-bb33")]


@pytest.mark.parametrize("visible,name,count", [
    (None, "A100", 3),
    ("1,0", "H200", 2),
    ("2", "L4", 1),
    ("GPU-bb3", "L4", 1),               # a UUID prefix
    ("GPU-bb", None, 0),                # ambiguous prefix: names no device
    ("0,7,1", "A100", 1),               # like CUDA: the list ends at the first invalid entry
    ("0,0", "A100", 1),
    ("-1", None, 0),
    ("", None, 0),
    ("MIG-123", None, 0),
])
def test_nvml_facts_follow_cuda_visible_devices(monkeypatch, visible, name, count):
    from sanitizer.capture import facts
    nvml = FakeNvml(DEVICES)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")     # CUDA's order is then NVML's
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    gpu = facts._nvml_facts()
    assert gpu["count"] == count and gpu.get("name") == name and gpu["driver"] == "580.1"
    assert nvml.log == ["init", "shutdown"]


@pytest.mark.parametrize("order,visible,devices,name", [
    (None, None, DEVICES, None),                   # fastest first: CUDA's 0 may be NVML's 1 or 2
    (None, "1", DEVICES, None),
    ("FASTEST_FIRST", "0,1", DEVICES, None),
    (None, "GPU-bb22", DEVICES, "H200"),           # a UUID names one device whatever the order
    (None, "1,0", [DEVICES[1]] * 3, "H200"),       # all alike: any of them says the same
    (None, None, DEVICES[:1], "A100"),             # one device
])
def test_nvml_facts_only_where_cuda_order_is_known(monkeypatch, order, visible, devices, name):
    """CUDA numbers devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID; NVML in PCI bus
    order. The count is right either way; the first device's name only where it is certain."""
    from sanitizer.capture import facts
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(devices))
    for var, value in (("CUDA_DEVICE_ORDER", order), ("CUDA_VISIBLE_DEVICES", visible)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    gpu = facts._nvml_facts()
    assert gpu.get("name") == name and ("capability" in gpu) == (name is not None)
    assert gpu["count"] == (len(devices) if visible is None else len(visible.split(",")))


def test_nvml_facts_without_a_driver_or_without_pynvml(monkeypatch):
    from sanitizer.capture import facts
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(DEVICES, fail_init=True))
    assert facts._nvml_facts() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)          # import pynvml raises ImportError
    assert facts._nvml_facts() is None


def test_cpu_build_has_no_gpu_and_asks_nothing(monkeypatch):
    """On this CPU build: gpu null, and neither NVML nor a device query is touched."""
    from sanitizer.capture import cuda_state, facts
    nvml = FakeNvml(DEVICES)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    for name in ("is_available", "current_device", "device_count", "_lazy_init", "init"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: pytest.fail(f"torch.cuda.{_n} called"))
    assert not cuda_state.compiled() and not cuda_state.initialized()
    assert cuda_state.current_device() is None and cuda_state.current_device(0) == 0
    assert facts._device_facts(torch, {}) == {"gpu": None} and nvml.log == []


def test_cuda_state_on_a_faked_initialised_cuda(monkeypatch):
    from sanitizer.capture import cuda_state
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 2, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert cuda_state.compiled() and cuda_state.current_device() is None   # not initialised
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert cuda_state.initialized() and cuda_state.current_device() == 1
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1 / 0)
    assert cuda_state.current_device(7) == 7                              # a failure: the default
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: 1 / 0)
    assert not cuda_state.initialized()


def test_group_device(monkeypatch):
    from sanitizer.capture import cuda_state
    assert cuda_state.group_device(types.SimpleNamespace(bound_device_id=torch.device("cuda", 5))) == "cuda:5"
    assert cuda_state.group_device(types.SimpleNamespace(bound_device_id=None)) == "cuda:0"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert cuda_state.group_device(object()) == "cuda:2"


def test_streams_and_devices_without_cuda_initialised(monkeypatch):
    """The stream/device helpers of cuda_hooks, nccl and streams name the default stream of
    device 0 and never reach torch.cuda.current_stream / current_device before initialisation."""
    from sanitizer.capture import cuda_hooks, nccl
    from sanitizer.capture.streams import StreamIds
    for name in ("current_stream", "current_device", "is_available", "_lazy_init"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: pytest.fail(f"torch.cuda.{_n} called"))
    ids = StreamIds()
    assert ids.current() == "cuda:0" and ids.current(torch.device("cuda", 2)) == "cuda:2"
    assert cuda_hooks._current_device() == 0 and nccl._current_device() == 0
    assert cuda_hooks._current_stream(ids) == "cuda:0"
    generic = torch.Stream(stream_id=3, device_index=1, device_type=1)
    hooks = cuda_hooks.CudaOrdering(types.SimpleNamespace(streams=ids))
    assert hooks.stream_of_torch(generic) == "cuda:1"


def test_register_mem_pool_marks_a_window_only_with_symm_and_names_the_group(tmp_path):
    """ProcessGroupNCCL.register_mem_pool (absent from a CPU build) is called on the *backend*:
    C++ registerMemPool(MemPool* pool, bool symm = false) registers the pool's segments as
    symmetric windows only with symm=True (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp). A
    Backend has no group_name; distributed_c10d.py sets `backend_options.group_name`. Driven here
    on the real backend object of a gloo group, whose options carry the name the same way."""
    import torch.distributed as dist
    from sanitizer.capture.torch_hooks import WindowPools, backend_group_name, register_mem_pool_hook

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        pg = dist.new_group([0])
        backend = pg._get_backend(torch.device("cpu"))
        assert not hasattr(backend, "group_name")
        assert backend_group_name(backend) == pg.group_name

        class Capture:
            failures = []

            def failed(self, hook, exc):
                self.failures.append((hook, exc))

        class Pool:                      # what WindowPools reads of a torch.cuda.MemPool: its id
            def __init__(self, pid):
                self.id = pid

        calls, windows, cap = [], WindowPools(), Capture()
        hook = register_mem_pool_hook(cap, windows, lambda self, pool, *a, **k: calls.append((pool.id, a, k)))
        local, symm_kw, symm_pos = Pool((1, 1)), Pool((1, 2)), Pool((1, 3))
        hook(backend, local)
        hook(backend, symm_kw, symm=True)
        hook(backend, symm_pos, True)
        assert len(calls) == 3 and not cap.failures
        assert windows.comm(local) is None
        assert windows.comm(symm_kw) == windows.comm(symm_pos) == pg.group_name
    finally:
        dist.destroy_process_group()
