"""Hand-worked placements, one test per allocator rule (c10/cuda/CUDACachingAllocator.cpp)."""
import pytest

from sanitizer.place import (
    MB,
    AllocatorConfig,
    Arena,
    CachingAllocator,
    ConfigError,
    DeviceDriver,
    OutOfMemory,
    PlacementError,
    round_size,
)

KB = 1024
DEFAULTS = AllocatorConfig()


# ---------------------------------------------------------------- rounding -----------------
@pytest.mark.parametrize("req,rounded", [(0, 512), (1, 512), (511, 512), (512, 512), (513, 1024),
                                         (1000, 1024), (1 * MB, 1 * MB), (1 * MB + 1, 1 * MB + 512)])
def test_round_size_512_granularity(req, rounded):
    assert round_size(req, DEFAULTS) == rounded


def test_roundup_power2_divisions_single_value():
    cfg = AllocatorConfig.parse("roundup_power2_divisions:4")
    # 1_200_000 lies in [1 MiB, 2 MiB): quarters are 1.0, 1.25, 1.5, 1.75 MiB -> 1.25 MiB
    assert round_size(1_200_000, cfg) == 1_310_720
    # below 512 * divisions the plain 512 rounding applies
    assert round_size(1200, cfg) == 1536
    # powers of two stay
    assert round_size(2 * MB, cfg) == 2 * MB


def test_roundup_power2_divisions_per_interval():
    cfg = AllocatorConfig.parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    # 300 MiB is in the 256 MiB interval: 1 division = no power-2 rounding
    assert round_size(300 * MB + 1, cfg) == 300 * MB + 512
    # 600 MiB is in the 512 MiB interval: halves -> 768 MiB
    assert round_size(600 * MB, cfg) == 768 * MB
    # '>' fills from the last named interval onwards (PyTorch's std::fill from last_index)
    assert cfg.roundup_power2_divisions[10:] == (8,) * 6


# ---------------------------------------------------------------- pools and segment sizes ---
def test_small_and_large_pool_segment_sizes():
    a = CachingAllocator()
    small = a.malloc(1 * MB)                      # <= 1 MiB: small pool, 2 MiB segment
    assert small.segment.size == 2 * MB and small.segment.is_small
    large = a.malloc(1 * MB + 1)                  # > 1 MiB: large pool, 20 MiB segment
    assert large.segment.size == 20 * MB and not large.segment.is_small
    assert a.malloc(10 * MB - 512).segment.size == 20 * MB   # below 10 MiB: shared 20 MiB segment
    assert a.malloc(10 * MB).segment.size == 10 * MB         # from 10 MiB: own segment, 2 MiB rounding
    assert a.malloc(11 * MB).segment.size == 12 * MB


def test_large_segment_size_mb():
    a = CachingAllocator(AllocatorConfig.parse("large_segment_size_mb:40"))
    assert a.malloc(3 * MB).segment.size == 40 * MB


# ---------------------------------------------------------------- split thresholds ----------
def test_small_pool_splits_when_512_bytes_remain():
    a = CachingAllocator()
    x = a.malloc(1 * MB)
    y = a.malloc(1 * MB - 512)                    # remaining 512 >= 512: split
    z = a.malloc(512)
    assert y.segment is x.segment and y.offset == 1 * MB and y.size == 1 * MB - 512
    assert z.segment is x.segment and z.offset == 2 * MB - 512
    assert a.malloc(512).segment is not x.segment  # segment full: new segment


def test_small_pool_exact_fit_takes_whole_block():
    a = CachingAllocator()
    x = a.malloc(1 * MB)
    y = a.malloc(1 * MB)
    assert y.segment is x.segment and y.offset == 1 * MB and y.size == 1 * MB


def test_large_pool_splits_only_when_more_than_1mib_remains():
    a = CachingAllocator()
    whole = a.malloc(19 * MB)                     # remaining exactly 1 MiB: not split
    assert whole.size == 20 * MB and whole.requested == 19 * MB
    assert a.malloc(2 * MB).segment is not whole.segment
    b = CachingAllocator()
    part = b.malloc(19 * MB - 512)                # remaining 1 MiB + 512: split
    assert part.size == 19 * MB - 512
    rest = b.malloc(1 * MB + 512)
    assert rest.segment is part.segment and rest.offset == 19 * MB - 512


# ---------------------------------------------------------------- best fit ------------------
def test_best_fit_by_size_then_address():
    a = CachingAllocator()
    blk = {}
    for name, size in [("a", 4 * KB), ("s1", 512), ("c", 8 * KB), ("s2", 512), ("e", 4 * KB), ("s3", 512)]:
        blk[name] = a.malloc(size)
    addr = {name: b.addr for name, b in blk.items()}   # a freed Block object may be reused
    for name in ("a", "c", "e"):
        a.free(blk[name])
    first = a.malloc(4 * KB)
    second = a.malloc(4 * KB)
    third = a.malloc(5000)                        # 5120 bytes: only c (8 KiB) fits; low end of c
    assert first.addr == addr["a"]                # equal sizes: lower address first
    assert second.addr == addr["e"]
    assert third.addr == addr["c"] and third.size == 5120


# ---------------------------------------------------------------- streams -------------------
def test_no_cross_stream_reuse():
    a = CachingAllocator()
    x = a.malloc(4 * KB, stream=0)
    x_addr, x_seg = x.addr, x.segment
    a.free(x)                                     # the whole segment is free again
    y = a.malloc(4 * KB, stream=1)
    assert y.segment is not x_seg and y.stream == 1
    z = a.malloc(4 * KB, stream=0)
    assert z.addr == x_addr


# ---------------------------------------------------------------- coalescing ----------------
def test_coalescing_restores_whole_segment():
    a = CachingAllocator()
    x, y, z = a.malloc(4 * KB), a.malloc(8 * KB), a.malloc(4 * KB)
    seg = x.segment
    assert len(a.segment_blocks(seg)) == 4        # x y z + free tail
    a.free(x)
    a.free(z)                                     # z merges with the tail
    assert [b.size for b in a.segment_blocks(seg)] == [4 * KB, 8 * KB, 2 * MB - 12 * KB]
    a.free(y)                                     # merges both sides
    blocks = a.segment_blocks(seg)
    assert len(blocks) == 1 and blocks[0].size == 2 * MB and blocks[0].addr == seg.addr


# ---------------------------------------------------------------- max_split_size_mb ---------
def test_max_split_oversize_blocks_not_split_and_not_given_to_small_requests():
    a = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:32"))
    big = a.malloc(40 * MB)
    big_addr = big.addr
    a.free(big)
    small = a.malloc(4 * MB)                      # < max_split: may not take the 40 MiB block
    assert small.segment is not big.segment and small.segment.size == 20 * MB
    again = a.malloc(36 * MB)                     # >= max_split and 40 < 36 + 20: takes it whole
    assert again.addr == big_addr and again.size == 40 * MB


def test_max_split_rounding_limit():
    a = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:32"))
    blk = a.malloc(60 * MB)
    a.free(blk)
    other = a.malloc(33 * MB)                     # 60 >= 33 + 20: refused, new segment
    assert other.segment is not blk.segment
    b = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:32,max_non_split_rounding_mb:30"))
    blk = b.malloc(60 * MB)
    b.free(blk)
    assert b.malloc(33 * MB).addr == blk.addr     # 60 < 33 + 30: taken whole


def test_large_request_below_max_split_is_split_as_usual():
    a = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:32"))
    x = a.malloc(4 * MB)
    y = a.malloc(4 * MB)
    assert y.segment is x.segment and y.offset == 4 * MB


# ---------------------------------------------------------------- record_stream -------------
def test_record_stream_holds_block_until_free_done():
    a = CachingAllocator()
    x = a.malloc(4 * KB, stream=0)
    a.record_stream(x, 1)
    assert a.free(x) is False                     # held: stream 1 may still use it
    y = a.malloc(4 * KB, stream=0)
    assert y.addr != x.addr and y.addr == x.addr + 4 * KB
    a.free_done(x)
    z = a.malloc(4 * KB, stream=0)
    assert z.addr == x.addr


def test_held_block_blocks_merges_until_free_done():
    a = CachingAllocator()
    x, y = a.malloc(4 * KB), a.malloc(4 * KB)
    a.record_stream(x, "side")
    a.free(x)
    a.free(y)
    seg = x.segment
    assert [b.size for b in a.segment_blocks(seg)] == [4 * KB, 2 * MB - 4 * KB]
    assert a.process_events(finished_streams=["other"]) == []
    assert a.process_events(finished_streams=["side"]) == [x]
    assert [b.size for b in a.segment_blocks(seg)] == [2 * MB]


def test_record_stream_on_own_stream_is_ignored():
    a = CachingAllocator()
    x = a.malloc(4 * KB, stream=3)
    a.record_stream(x, 3)
    assert a.free(x) is True
    with pytest.raises(PlacementError):
        a.free_done(x)
    with pytest.raises(PlacementError):
        a.free(x)


# ---------------------------------------------------------------- private pools -------------
def test_private_pool_is_separate_from_default():
    a = CachingAllocator()
    d = a.malloc(4 * KB)
    d_addr, d_seg = d.addr, d.segment
    a.free(d)
    a.create_pool("graph:1", kind="graph")
    g = a.malloc(4 * KB, pool="graph:1")
    g_addr = g.addr
    assert g.segment is not d_seg and g.pool == "graph:1" and g.offset == 0
    a.free(g)
    assert a.malloc(4 * KB).addr == d_addr        # the default pool never takes the graph's block
    assert a.malloc(4 * KB, pool="graph:1").addr == g_addr
    with pytest.raises(PlacementError):
        a.malloc(1, pool="nope")


def test_no_split_pool_hands_out_whole_segments():
    a = CachingAllocator()
    a.create_pool("symm", no_split=True)
    x = a.malloc(4 * KB, pool="symm")
    y = a.malloc(4 * KB, pool="symm")
    assert x.size == 2 * MB and y.segment is not x.segment
    big = a.malloc(3 * MB, pool="symm")
    assert big.size == 20 * MB
    a.free(x)
    assert a.malloc(100, pool="symm").addr == x.addr


# ---------------------------------------------------------------- pluggable segments --------
def test_pool_fed_by_window_arena_window_offsets():
    a = CachingAllocator()
    win = Arena(base=0x10000000, capacity=64 * MB, name="tp")
    a.create_pool("symm", segment_source=win)
    x = a.malloc(1 * MB, pool="symm")
    y = a.malloc(5 * MB, pool="symm")             # large: a 20 MiB segment after the 2 MiB one
    z = a.malloc(700 * KB, pool="symm")           # small: rest of the first segment
    assert (x.window_offset, y.window_offset, z.window_offset) == (0, 2 * MB, 1 * MB)
    assert z.window_offset == z.addr - win.base
    a.malloc(15 * MB, pool="symm")                # fits the 20 MiB segment's remainder? 15 > 15-... no
    a.malloc(5 * MB, pool="symm")
    with pytest.raises(OutOfMemory):
        for _ in range(4):
            a.malloc(12 * MB, pool="symm")        # 12 MiB segments: the window fills up
    d = a.malloc(4 * KB)                          # the default pool is elsewhere
    assert d.window_offset is None and not win.contains(d.addr)


def test_arena_reuses_released_ranges_lowest_first():
    a = CachingAllocator()
    win = Arena(base=0, capacity=8 * MB)
    a.create_pool("w", segment_source=win)
    blocks = [a.malloc(1 * MB, pool="w") for _ in range(2)]
    third = a.malloc(1 * MB, pool="w")            # second segment
    assert third.window_offset == 2 * MB
    for b in blocks:
        a.free(b)
    released = a.empty_cache("w")
    assert [s.addr for s in released] == [0]
    again = a.malloc(4 * KB, pool="w")            # the second segment has room: no new segment
    assert again.segment is third.segment
    assert win.allocate(2 * MB) == 0              # the released range is first-fit again


def test_fake_driver_is_deterministic_and_2mib_aligned():
    d1, d2 = DeviceDriver(), DeviceDriver()
    seq = [2 * MB, 20 * MB, 12 * MB, 2 * MB]
    assert [d1.allocate(s) for s in seq] == [d2.allocate(s) for s in seq]
    assert all(x % (2 * MB) == 0 for x in d1.live)


# ---------------------------------------------------------------- configuration -------------
@pytest.mark.parametrize("conf,needle", [
    ("expandable_segments:True", "expandable_segments:True is not modelled"),
    ("backend:cudaMallocAsync", "cudaMallocAsync is not modelled"),
    ("graph_capture_record_stream_reuse:True", "not modelled"),
    ("per_process_memory_fraction:0.5", "not modelled"),
    ("max_split_size_mb:10", "too small"),
    ("bogus_key:1", "unrecognized"),
    ("max_split_size_mb", "expected ':'"),
    ("roundup_power2_divisions:3", "power of 2"),
])
def test_config_refusals(conf, needle):
    with pytest.raises(ConfigError) as exc:
        AllocatorConfig.parse(conf)
    assert needle in str(exc.value) and conf.split(":")[0] in str(exc.value)


def test_config_accepts_inert_and_modelled_keys():
    cfg = AllocatorConfig.parse(" expandable_segments:False, backend:native,"
                                "release_lock_on_cudamalloc:True, max_split_size_mb:256,"
                                "pinned_num_register_threads:8")
    assert cfg.max_split_size == 256 * MB
    assert AllocatorConfig.parse("") == AllocatorConfig()


def test_config_from_env_prefers_pytorch_alloc_conf():
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert AllocatorConfig.from_env(env).max_split_size == 64 * MB
    assert AllocatorConfig.from_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}).max_split_size == 128 * MB


# ---------------------------------------------------------------- the GPU comparison -----------
def test_gpu_check_sequence_model_side_hand_worked():
    from sanitizer.place.gpu_check import compare, run_model

    m = run_model()
    assert m["e"] == (1, 8 * MB, 12 * MB)        # 12 MiB reuses the exact 12 MiB rest of c's segment
    assert m["h"] == (1, 0, 3 * MB)              # 2 MiB in c's freed 3 MiB: 1 MiB left, not split
    # a was freed with record_stream on an idle side stream: malloc's process_events() finds the
    # free's event done and returns a to the pool first (c10/cuda/CUDACachingAllocator.cpp,
    # DeviceCachingAllocator::malloc), so i takes a's bytes
    assert m["i"] == (0, 0, 1024)
    assert m["j"] == (0, 1024 + 200 * KB, 1024)  # after f, in the rest of b's freed bytes
    assert m["n"] == (1, 3 * MB, 9 * MB) and m["o"][1:] == (0, 20 * MB)
    assert m["k"][0] == m["m"][0] != m["a"][0]   # the MemPool has its own segments
    observed = dict(m)
    observed["j"] = (0, 1024, None)
    rate, bad = compare(m, observed)
    assert rate == (len(m) - 1) / len(m) and bad[0].startswith("j:")


def test_malloc_recycles_a_record_stream_block_whose_streams_are_done():
    """DeviceCachingAllocator::malloc begins with process_events(): the events recorded at the free
    of record_stream'd blocks are queried, and completed ones return their blocks to the pool
    (c10/cuda/CUDACachingAllocator.cpp). Whether a stream is done is the caller's knowledge."""
    busy = {"side"}
    a = CachingAllocator(stream_done=lambda s: s not in busy)
    x = a.malloc(4096, "main")
    a.record_stream(x, "side")
    assert a.free(x) is False                    # held: the event on side is pending
    y = a.malloc(4096, "main")                   # side still busy: y goes elsewhere
    assert y.addr != x.addr and x.pending
    busy.clear()                                 # side finished its work
    z = a.malloc(4096, "main")
    assert z.addr == x.addr and not a.held
    plain = CachingAllocator()                   # no stream knowledge: held until free_done
    x2 = plain.malloc(4096, "main")
    plain.record_stream(x2, "side")
    plain.free(x2)
    assert plain.malloc(4096, "main").addr != x2.addr and plain.held


def test_placement_package_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, sanitizer.place, sanitizer.place.replay, sanitizer.place.sweep, "
            "sanitizer.place.gpu_check, sanitizer.commands.place, sanitizer.commands.sweep; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
