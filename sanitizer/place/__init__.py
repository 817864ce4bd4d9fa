"""Placement model of PyTorch's CUDA caching allocator (torch-free).

Where would a block land on a GPU? Replays allocation requests (size, stream, pool) through a model
of c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.4 .. 2.14; see allocator.py for the rules and the
source versions read) and returns blocks with addresses. Absolute addresses come from a deterministic
fake driver (real cudaMalloc addresses are not ordered); offsets within segments and windows are
what the model predicts.

Entry points (stable; other parts of hazsan code against these):

    from sanitizer.place import AllocatorConfig, CachingAllocator, Arena, DeviceDriver

    cfg = AllocatorConfig.parse("max_split_size_mb:128")      # or AllocatorConfig.from_env()
    alloc = CachingAllocator(cfg)                               # ConfigError for unmodelled keys
    b = alloc.malloc(4096, stream=0)                            # -> AllocatorBlock
    b.addr, b.size, b.requested, b.stream, b.pool, b.segment    # segment: Segment(addr, size, pool, ...)
    b.offset                                                    # b.addr - b.segment.addr
    alloc.record_stream(b, stream=1)
    alloc.free(b)            # False: held until free_done (a record_stream stream still runs)
    alloc.free_done(b)       # now cached, coalesced with free neighbours
    alloc.process_events(finished_streams=None)   # release every held block whose streams finished

    # a pool whose segments live in a window [base, base+capacity) (SGLang's ncclMemAlloc pool,
    # the CPU symmetric-memory testbed); window offset = block.addr - base
    win = Arena(base=0x10000000, capacity=64 << 20, name="tp-window")
    alloc.create_pool("symm", segment_source=win)
    blk = alloc.malloc(1 << 20, stream=0, pool="symm")
    blk.window_offset                                           # == blk.addr - win.base
    alloc.create_pool("torch-symm", no_split=True)              # torch symmetric memory pool
    alloc.create_pool("graph:1", kind="graph")                  # a CUDA graph's private pool

    # segment events as they happen
    CachingAllocator(cfg, on_segment=lambda seg: print(seg.addr, seg.size, seg.pool))

Errors: ConfigError (bad or unmodelled PYTORCH_CUDA_ALLOC_CONF), PlacementError (double free,
unknown pool, ...), OutOfMemory (an Arena is full).
"""
from .allocator import (
    DEFAULT_POOL,
    AllocatorBlock,
    BlockPool,
    CachingAllocator,
    PlacementError,
    Pool,
    allocation_size,
    round_size,
    roundup_power2_next_division,
)
from .config import MB, AllocatorConfig, ConfigError
from .segments import (
    DEFAULT_DEVICE_BASE,
    DEFAULT_PLUGGABLE_BASE,
    Arena,
    DeviceDriver,
    OutOfMemory,
    Segment,
    SegmentSource,
)

__all__ = [
    "AllocatorBlock", "AllocatorConfig", "Arena", "BlockPool", "CachingAllocator", "ConfigError",
    "DEFAULT_DEVICE_BASE", "DEFAULT_PLUGGABLE_BASE", "DEFAULT_POOL", "DeviceDriver", "MB",
    "OutOfMemory", "PlacementError", "Pool", "Segment", "SegmentSource", "allocation_size",
    "round_size", "roundup_power2_next_division",
]
