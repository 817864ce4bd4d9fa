"""NCCL through its Python ctypes wrapper: SGLang's and vLLM's `NCCLLibrary` (pynccl).

SGLang runs every symmetric-memory all-reduce, all-gather and reduce-scatter through
`PyNcclCommunicator` -> `pynccl_wrapper.NCCLLibrary`, a class whose methods call libnccl through
ctypes. torch.distributed never sees these calls. SGLang's class is adapted from vLLM's and both
keep the method names and argument order, so one class-level hook serves both.

What each method becomes
  * ncclAllReduce / Reduce / ReduceScatter / AllGather / Broadcast / Send / Recv -> `coll` with
    `bufs` = pointer x count x dtype size (send side "r", receive side "w", "rw" when in place),
    `stream` = the cudaStream_t through the process's StreamIds table (the ids allocations use),
    `comm` = the communicator's name (below), `seq` = per-communicator counter, equal across ranks.
    A pointer inside a recorded block names that block's trace range (block_table.BlockTable.resolve),
    so a slice of a tensor placed in a modelled window is recorded at its modelled address.
  * ncclGroupStart / ncclGroupEnd: the calls in between are one NCCL operation: one `coll` at the
    outermost ncclGroupEnd, with every part's buffers (op "group:ncclSend+ncclRecv", ...).
  * ncclSend / ncclRecv (alone, or a group whose parts all talk to one peer): comm
    "<comm>:p2p:<lo>-<hi>" (the pair of ranks in the communicator), so seq is equal on both ends.
  * ncclMemAlloc / ncclMemFree -> `segment` / `segment_free` (pool "ncclMemAlloc");
    ncclCommWindowRegister / Deregister -> `window` / `window_free`, only for a symmetric window:
    the one kind peers access by offset (NCCL runs its symmetric kernels only on windows whose
    winFlags carry NCCL_WIN_COLL_SYMMETRIC on both sides: src/scheduler/symmetric_sched.cc,
    src/enqueue.cc, 2.28.9). What NCCL hands back is not always one (src/dev_runtime.cc):
      - 2.29+: `*win = nullptr` and ncclSuccess when the communicator has no symmetric support
        (`if (!comm->symmetricSupport) return ncclSuccess;`): no window. SGLang
        (pynccl_allocator.allocate_symmetric_buffer: `window = window if window.value else None`)
        reads that NULL as "no window", and so does capture;
      - 2.28: ncclDevrWindowRegisterInGroup registers the buffer locally (ncclCommRegister) and,
        where `!comm->symmetricSupport`, returns that local-registration handle as the window:
        non-NULL, and no window ("2.28.x returns a local-registration handle", SGLang says; "the
        returned flag means a symmetric window only on NCCL >= 2.29.2"). symmetricSupport is
        `isAllCudaP2p && ncclParamWinEnable() && ncclCuMemEnable()` (src/init.cc, 2.28.9 and
        2.29.2, which adds `&& (ginSupport || nNodes == 1)`): capture reads the environment half
        of it when the communicator is made (NCCL_WIN_ENABLE=0 or NCCL_CUMEM_ENABLE=0: SGLang sets
        the latter to 0 unless --enable-symm-mem or the KV-shard gather asks for cuMem,
        entrypoints/engine.py), and a handle on such a communicator is a local registration;
      - a registration without NCCL_WIN_COLL_SYMMETRIC in winFlags (NCCL_WIN_DEFAULT) is never
        run by a symmetric kernel, whatever the handle: not a window either.
    None of these three is written to the trace (a local registration gives peers no access).
    The communicator of a NULL or local handle is remembered (`no_symmetric`: the pool windows
    SGLang's C++ plugin registers for it, out of Python's sight, are not windows either). A
    2.28 handle on a communicator whose environment allows symmetric support is taken for a
    window: the missing half (every rank CUDA-P2P-reachable) is not visible from Python.
    The registration is a task run at group end: inside ncclGroupStart/End the handle is written
    by the outermost ncclGroupEnd, so the decision waits for it. Windows are keyed by
    (communicator, address).
  * ncclCommInitRank(Config) -> the communicator is learnt: its rank count, this process's rank in
    it, and its name. The name is "pynccl:<group_name>" when a PyNcclCommunicator creates it (the
    ProcessGroup it is built on; equal on every rank), else "nccl:<hash of the unique id>".

Completion: NCCL runs the kernel asynchronously on `stream`; the call returning says nothing about
it being done. No `coll_done` is ever written here: the analysis orders later work by the stream
(same-stream work is ordered after it) and by the waits and syncs that capture records elsewhere.

Host memory: without a GPU (tests, CPU emulations that fake the library), the buffers are CPU
storages and the "kernel" runs in the host's order; the collective is then recorded on stream
"cpu", the stream CPU allocations carry, whatever handle was passed.
"""
from __future__ import annotations

import functools
import hashlib
import threading

# ncclDataType_t -> bytes per element (nccl.h: int8, uint8, int32, uint32, int64, uint64, half,
# float, double, bfloat16, then the fp8 types e4m3 and e5m2).
# nccl.h (2.27+): the winFlags bit asking for a window symmetric kernels may use
NCCL_WIN_COLL_SYMMETRIC = 0x01

DTYPE_SIZE = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1}

# method -> (argument names after self, how the buffers are read from them)
COLLECTIVES = {
    "ncclAllReduce": ("sendbuff", "recvbuff", "count", "datatype", "op", "comm", "stream"),
    "ncclReduce": ("sendbuff", "recvbuff", "count", "datatype", "op", "root", "comm", "stream"),
    "ncclReduceScatter": ("sendbuff", "recvbuff", "count", "datatype", "op", "comm", "stream"),
    "ncclAllGather": ("sendbuff", "recvbuff", "count", "datatype", "comm", "stream"),
    "ncclBroadcast": ("sendbuff", "recvbuff", "count", "datatype", "root", "comm", "stream"),
    "ncclSend": ("sendbuff", "count", "datatype", "peer", "comm", "stream"),
    "ncclRecv": ("recvbuff", "count", "datatype", "peer", "comm", "stream"),
}


def _int(v) -> int:
    """A ctypes pointer/handle (c_void_p, its .value None for NULL), an int, or None -> int."""
    if v is None:
        return 0
    value = getattr(v, "value", v)
    return int(value or 0)


class Comm:
    __slots__ = ("name", "nranks", "rank")

    def __init__(self, name: str, nranks: int | None, rank: int | None):
        self.name, self.nranks, self.rank = name, nranks, rank


class NcclCalls:
    """The state behind the NCCLLibrary hook: communicators, seq counters, open groups."""

    def __init__(self, capture):
        self.capture = capture
        self.comms: dict[int, Comm] = {}       # ncclComm_t value -> Comm
        self.seq: dict[str, int] = {}
        self.windows: dict[tuple[str, int], object] = {}   # (comm, addr) -> its ncclWindow_t
        self.no_symmetric: set[str] = set()     # comms without symmetric support: a NULL window
                                                # returned, or the environment rules it out
        self.local = threading.local()          # .group_depth, .parts, .windows, .pending_name
        self.version: int | None = None         # ncclGetRawVersion's answer (22903 = 2.29.3)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ communicators
    def learn(self, comm, nranks, rank, unique_id) -> None:
        name = getattr(self.local, "pending_name", None)
        if not name:
            raw = bytes(bytearray(getattr(unique_id, "internal", b"") or b""))
            name = "nccl:" + hashlib.sha1(raw).hexdigest()[:10]
        self.comms[_int(comm)] = Comm(name, int(nranks), int(rank))
        if not symmetric_env_allows():
            self.no_symmetric.add(name)

    def comm(self, handle) -> Comm:
        key = _int(handle)
        c = self.comms.get(key)
        if c is None:     # created before capture started, or by another path: a local name
            c = self.comms[key] = Comm(f"ncclComm:{key:#x}", None, None)
        return c

    def name_of(self, handle) -> str | None:
        c = self.comms.get(_int(handle))
        return c.name if c is not None else None

    # ------------------------------------------------------------------ collectives
    def call(self, method: str, a: dict) -> None:
        """Record one collective or p2p call (or queue it as a part of the open group)."""
        comm = self.comm(a["comm"])
        elem = DTYPE_SIZE.get(int(a["datatype"]), 1)
        n = int(a["count"]) * elem
        nranks = comm.nranks or 1
        root = a.get("root")
        me = comm.rank
        bufs = []                               # (ptr, nbytes, access)
        send, recv = _int(a.get("sendbuff")), _int(a.get("recvbuff"))
        if method == "ncclAllReduce":
            bufs = [(send, n, "rw")] if send == recv else [(send, n, "r"), (recv, n, "w")]
        elif method == "ncclAllGather":
            bufs = [(send, n, "r"), (recv, n * nranks, "w")]
            if recv <= send < recv + n * nranks:     # in place: the input is a slice of the output
                bufs = [(recv, n * nranks, "rw")]
        elif method == "ncclReduceScatter":
            bufs = [(send, n * nranks, "r"), (recv, n, "w")]
        elif method == "ncclReduce":
            bufs = [(send, n, "r")]
            if me is None or me == root:
                bufs = [(send, n, "rw")] if send == recv else bufs + [(recv, n, "w")]
        elif method == "ncclBroadcast":
            if send and send == recv:
                bufs = [(send, n, "rw")]
            else:
                bufs = ([(send, n, "r")] if send else []) + [(recv, n, "w")]
        elif method == "ncclSend":
            bufs = [(send, n, "r")]
        elif method == "ncclRecv":
            bufs = [(recv, n, "w")]
        peer = a.get("peer") if method in ("ncclSend", "ncclRecv") else None
        part = (method, comm, _int(a["stream"]), [b for b in bufs if b[0]], peer)
        local = self.local
        if getattr(local, "group_depth", 0):
            local.parts.append(part)
        else:
            self._emit([part])

    def group_start(self) -> None:
        local = self.local
        depth = getattr(local, "group_depth", 0)
        if depth == 0:
            local.parts = []
            local.windows = []
        local.group_depth = depth + 1

    def group_end(self) -> None:
        local = self.local
        depth = getattr(local, "group_depth", 0)
        if depth <= 0:
            return
        local.group_depth = depth - 1
        if depth == 1:
            windows, local.windows = getattr(local, "windows", []), []
            for w in windows:                  # their handles are written now (dev_runtime.cc)
                self._window_made(*w)
            parts, local.parts = local.parts, []
            if parts:
                by_comm: dict = {}
                for p in parts:
                    by_comm.setdefault((id(p[1]), p[2]), []).append(p)
                for group in by_comm.values():
                    self._emit(group)

    def _emit(self, parts) -> None:
        cap = self.capture
        comm, handle = parts[0][1], parts[0][2]
        ops = []
        for p in parts:
            if p[0] not in ops:
                ops.append(p[0])
        op = ops[0] if len(parts) == 1 else "group:" + "+".join(ops)
        name = comm.name
        peers = {p[4] for p in parts}
        if all(p[0] in ("ncclSend", "ncclRecv") for p in parts) and len(peers) == 1:
            peer = int(next(iter(peers)))
            lo, hi = sorted((comm.rank if comm.rank is not None else -1, peer))
            name = f"{name}:p2p:{lo}-{hi}"
        table = cap.blocks
        bufs = []
        host = True
        for p in parts:
            for ptr, nbytes, access in p[3]:
                if table is not None:
                    addr, size, on_host = table.resolve(ptr, nbytes)
                else:
                    addr, size, on_host = ptr, nbytes, False
                host = host and on_host
                bufs.append({"addr": addr, "size": size, "access": access})
        if host and bufs:
            stream = "cpu"
        else:
            stream = cap.streams.of_handle(handle, _current_device())
        with self._lock:
            seq = self.seq.get(name, 0)
            self.seq[name] = seq + 1
        cap.event({"ev": "coll", "cid": cap.next_cid(), "comm": name, "seq": seq, "op": op,
                   "stream": stream, "bufs": bufs})

    # ------------------------------------------------------------------ memory and windows
    def mem_alloc(self, ptr, size) -> None:
        self.capture.event({"ev": "segment", "addr": _int(ptr), "size": int(size), "pool": "ncclMemAlloc"})

    def mem_free(self, ptr) -> None:
        self.capture.event({"ev": "segment_free", "addr": _int(ptr), "pool": "ncclMemAlloc"}, with_site=False)

    def window_register(self, comm, buff, size, window, flags) -> None:
        """`window`: the ncclWindow_t object the call filled (or will fill at group end);
        `flags`: the winFlags passed (None: not known, taken as symmetric, what SGLang passes)."""
        entry = (self.comm(comm).name, _int(buff), int(size), window, flags)
        if getattr(self.local, "group_depth", 0):
            self.local.windows.append(entry)
        else:
            self._window_made(*entry)

    def _window_made(self, name, addr, size, window, flags) -> None:
        if not _int(window):
            self.no_symmetric.add(name)        # 2.29+: success without a window, no symmetric support
            return
        if flags is not None and not int(flags) & NCCL_WIN_COLL_SYMMETRIC:
            return                             # asked for no symmetric use: no symmetric kernel reads it
        if name in self.no_symmetric and self.version_below(22902):
            return                             # 2.28: the local-registration handle, not a window
        self.no_symmetric.discard(name)        # 2.29+: a handle proves symmetric support
        self.windows[(name, addr)] = window
        self.capture.event({"ev": "window", "addr": addr, "size": size, "comm": name})

    def version_below(self, raw: int) -> bool:
        """Whether the NCCL in use is older than `raw` (ncclGetRawVersion's encoding), or unknown:
        a handle proves symmetric support only on 2.29.2 and later."""
        return self.version is None or self.version < raw

    def window_deregister(self, comm, window) -> None:
        name, handle = self.comm(comm).name, _int(window)
        if not handle:
            return
        for key, win in list(self.windows.items()):
            if key[0] == name and _int(win) == handle:
                del self.windows[key]
                self.capture.event({"ev": "window_free", "addr": key[1], "comm": name}, with_site=False)
                return


def symmetric_env_allows() -> bool:
    """False where the environment alone rules out NCCL's symmetric support for a communicator
    made now: `comm->symmetricSupport = isAllCudaP2p && ncclParamWinEnable() && ncclCuMemEnable()`
    (src/init.cc; NCCL_WIN_ENABLE defaults to 1, NCCL_CUMEM_ENABLE to -2 = use cuMem where the
    driver supports it: src/misc/cudawrap.cc). An integer that NCCL would read as 0 disables it;
    anything else leaves the decision to NCCL (nccl.conf files are not read here)."""
    import os
    for var in ("NCCL_WIN_ENABLE", "NCCL_CUMEM_ENABLE"):
        value = os.environ.get(var, "").strip()
        try:
            if value and int(value, 0) == 0:
                return False
        except ValueError:
            pass
    return True


def _current_device() -> int:
    """The current CUDA device once the program initialised CUDA, else 0: never initialises it
    (cuda_state.py; `torch.cuda.is_available()` would)."""
    from sanitizer.capture import cuda_state
    return cuda_state.current_device(0)


# ---------------------------------------------------------------------- installing the hook
def _calls(capture) -> NcclCalls:
    calls = getattr(capture, "nccl", None)
    if calls is None:
        calls = capture.nccl = NcclCalls(capture)
    return calls


def _wrap(cls, name, make):
    original = cls.__dict__.get(name)
    if original is None or getattr(original, "_hazsan", False):
        return False
    wrapper = functools.wraps(original)(make(original))
    wrapper._hazsan = True
    setattr(cls, name, wrapper)
    return True


def hook_library(capture, cls, label: str) -> list[str]:
    """Patch the NCCLLibrary class `cls` (SGLang's or vLLM's). Returns the methods hooked."""
    calls = _calls(capture)
    failed = capture.failed
    hooked = []

    def collective(method, names):
        def make(original):
            def wrapper(self, *args, **kwargs):
                try:
                    a = dict(zip(names, args))
                    a.update(kwargs)
                    if "dest" in a:
                        a["peer"] = a.pop("dest")
                    if "src" in a:
                        a["peer"] = a.pop("src")
                except Exception as exc:
                    failed(f"{label}.{method}", exc)
                    a = None
                r = original(self, *args, **kwargs)
                if a is not None:
                    try:
                        calls.call(method, a)
                    except Exception as exc:
                        failed(f"{label}.{method}", exc)
                return r
            return wrapper
        return make

    for method, names in COLLECTIVES.items():
        if _wrap(cls, method, collective(method, names)):
            hooked.append(method)

    def after(method, record):
        def make(original):
            def wrapper(self, *args, **kwargs):
                r = original(self, *args, **kwargs)
                try:
                    record(r, *args, **kwargs)
                except Exception as exc:
                    failed(f"{label}.{method}", exc)
                return r
            return wrapper
        return make

    def group_start(original):
        def wrapper(self, *args, **kwargs):
            r = original(self, *args, **kwargs)
            try:
                calls.group_start()
            except Exception as exc:
                failed(f"{label}.ncclGroupStart", exc)
            return r
        return wrapper

    def group_end(original):
        def wrapper(self, *args, **kwargs):
            try:
                r = original(self, *args, **kwargs)
            finally:   # a failed ncclGroupEnd still closes the group on this side
                try:
                    calls.group_end()
                except Exception as exc:
                    failed(f"{label}.ncclGroupEnd", exc)
            return r
        return wrapper

    def mem_free(original):
        def wrapper(self, ptr, *args, **kwargs):
            r = original(self, ptr, *args, **kwargs)
            try:
                calls.mem_free(ptr)
            except Exception as exc:
                failed(f"{label}.ncclMemFree", exc)
            return r
        return wrapper

    def deregister(original):
        def wrapper(self, comm, window, *args, **kwargs):
            r = original(self, comm, window, *args, **kwargs)
            try:
                calls.window_deregister(comm, window)
            except Exception as exc:
                failed(f"{label}.ncclCommWindowDeregister", exc)
            return r
        return wrapper

    def raw_version(original):
        def wrapper(self, *args, **kwargs):
            r = original(self, *args, **kwargs)
            try:
                v = int(r)     # 22903 -> "2.29.3" (NCCL >= 2.9's encoding: major*10000 + minor*100 + patch)
                capture.versions[f"nccl({label})"] = f"{v // 10000}.{v // 100 % 100}.{v % 100}"
                calls.version = v
            except Exception as exc:
                failed(f"{label}.ncclGetRawVersion", exc)
            return r
        return wrapper

    others = {
        "ncclGetRawVersion": raw_version,
        "ncclGroupStart": group_start,
        "ncclGroupEnd": group_end,
        "ncclCommInitRank": after("ncclCommInitRank",
                                  lambda r, nranks, uid, rank, *a, **k: calls.learn(r, nranks, rank, uid)),
        "ncclCommInitRankConfig": after("ncclCommInitRankConfig",
                                        lambda r, nranks, uid, rank, *a, **k: calls.learn(r, nranks, rank, uid)),
        "ncclMemAlloc": after("ncclMemAlloc", lambda r, size, *a, **k: calls.mem_alloc(r, size)),
        "ncclMemFree": mem_free,
        "ncclCommWindowRegister": after("ncclCommWindowRegister",
                                        lambda r, comm, buff, size, *a, **k:
                                        calls.window_register(comm, buff, size, r,
                                                              a[0] if a else k.get("win_flags"))),
        "ncclCommWindowDeregister": deregister,
    }
    for method, make in others.items():
        if _wrap(cls, method, make):
            hooked.append(method)
    return hooked


def hook_communicator(capture, cls, label: str) -> bool:
    """PyNcclCommunicator.__init__: name the NCCL communicator it creates after its ProcessGroup."""
    calls = _calls(capture)

    def make(original):
        def __init__(self, group, *args, **kwargs):
            local = calls.local
            previous = getattr(local, "pending_name", None)
            try:
                gname = getattr(group, "group_name", None)
                if not gname and hasattr(group, "world_size"):   # StatelessProcessGroup
                    gname = f"stateless{getattr(group, 'world_size', '')}"
                local.pending_name = f"pynccl:{gname}" if gname else None
            except Exception as exc:
                failed(f"{label}.__init__", exc)
            try:
                return original(self, group, *args, **kwargs)
            finally:
                local.pending_name = previous
        return __init__

    failed = capture.failed
    return _wrap(cls, "__init__", make)


def comm_name_of(capture, pynccl_comm) -> str | None:
    """The recorded name of a PyNcclCommunicator's NCCL communicator (None when not learnt)."""
    calls = getattr(capture, "nccl", None)
    comm = getattr(pynccl_comm, "comm", None)
    if calls is None or comm is None:
        return None
    return calls.name_of(comm)
