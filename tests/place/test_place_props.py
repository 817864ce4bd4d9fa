"""Property tests of the placement model: random request sequences, invariants after every step."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sanitizer.place import MB, AllocatorConfig, Arena, CachingAllocator, round_size

SIZES = st.one_of(
    st.integers(0, 4096),                 # tiny: 512-byte rounding
    st.integers(4096, 1 * MB),            # rest of the small pool
    st.integers(1 * MB + 1, 12 * MB),     # large pool, shared 20 MiB segments and own segments
    st.sampled_from([512, 1 * MB, 10 * MB, 19 * MB, 20 * MB]),
)
STREAMS = st.sampled_from([0, 1, 2])
POOLS = st.sampled_from([None, "priv", "nosplit", "window"])
CONFIGS = st.sampled_from(["", "max_split_size_mb:24", "roundup_power2_divisions:4",
                           "max_split_size_mb:32,max_non_split_rounding_mb:40"])

OP = st.one_of(
    st.tuples(st.just("malloc"), SIZES, STREAMS, POOLS),
    st.tuples(st.just("free"), st.integers(0, 10**6)),
    st.tuples(st.just("record"), st.integers(0, 10**6), STREAMS),
    st.tuples(st.just("done"), st.integers(0, 10**6)),
)


def _model(conf):
    a = CachingAllocator(AllocatorConfig.parse(conf))
    a.create_pool("priv")
    a.create_pool("nosplit", no_split=True)
    a.create_pool("window", segment_source=Arena(base=1 << 40, capacity=1 << 36))
    return a


def _check_invariants(a: CachingAllocator):
    occupied = sorted((b.addr, b.end) for b in a.live | a.held)
    for (s1, e1), (s2, e2) in zip(occupied, occupied[1:]):
        assert e1 <= s2, "two live blocks overlap"
    for pool in a.pools.values():
        for seg in pool.segments:
            blocks = a.segment_blocks(seg)
            assert blocks[0].addr == seg.addr and blocks[-1].end == seg.end
            for x, y in zip(blocks, blocks[1:]):
                assert x.end == y.addr, "a segment's blocks must tile it"
                assert not (x.is_free and y.is_free), "two free neighbours were not coalesced"
            for b in blocks:
                assert b.stream == seg.stream, "a block was handed to another stream"
                assert b.pool == pool.name
            if pool.no_split:
                assert len(blocks) == 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conf=CONFIGS, ops=st.lists(OP, max_size=60))
def test_random_sequences_keep_invariants(conf, ops):
    a = _model(conf)
    live, held = [], []
    for op in ops:
        if op[0] == "malloc":
            _, size, stream, pool = op
            b = a.malloc(size, stream, pool)
            assert b.stream == stream and b.size >= round_size(size, a.config) >= size
            assert b.segment.addr <= b.addr and b.end <= b.segment.end
            live.append(b)
        elif op[0] == "free" and live:
            b = live.pop(op[1] % len(live))
            if not a.free(b):
                held.append(b)
        elif op[0] == "record" and live:
            a.record_stream(live[op[1] % len(live)], op[2])
        elif op[0] == "done" and held:
            a.free_done(held.pop(op[1] % len(held)))
        _check_invariants(a)


@settings(max_examples=120, deadline=None)
@given(conf=CONFIGS, reqs=st.lists(st.tuples(SIZES, STREAMS, POOLS), min_size=1, max_size=40),
       data=st.data())
def test_freed_bytes_are_reusable_without_new_segments(conf, reqs, data):
    a = _model(conf)
    blocks = [a.malloc(s, st_, p) for s, st_, p in reqs]
    victim = data.draw(st.integers(0, len(blocks) - 1))
    b = blocks[victim]
    size, stream, pool = b.requested, b.stream, reqs[victim][2]
    a.free(b)
    segments_before = sum(len(p.segments) for p in a.pools.values())
    again = a.malloc(size, stream, pool)
    assert sum(len(p.segments) for p in a.pools.values()) == segments_before
    assert again.stream == stream


@settings(max_examples=120, deadline=None)
@given(conf=CONFIGS, reqs=st.lists(st.tuples(SIZES, STREAMS, POOLS, st.booleans()), max_size=40),
       order=st.randoms(use_true_random=False))
def test_freeing_everything_restores_whole_segments(conf, reqs, order):
    a = _model(conf)
    blocks = []
    for size, stream, pool, record in reqs:
        b = a.malloc(size, stream, pool)
        if record:
            a.record_stream(b, (stream + 1) % 3)
        blocks.append(b)
    order.shuffle(blocks)
    for b in blocks:
        a.free(b)
    a.process_events()            # every recorded stream finished
    assert not a.live and not a.held
    for pool in a.pools.values():
        for seg in pool.segments:
            blocks = a.segment_blocks(seg)
            assert len(blocks) == 1 and blocks[0].size == seg.size and blocks[0].is_free


@settings(max_examples=80, deadline=None)
@given(reqs=st.lists(st.tuples(SIZES, STREAMS), min_size=2, max_size=30))
def test_a_block_is_never_handed_to_another_stream(reqs):
    a = _model("")
    for size, stream in reqs:
        b = a.malloc(size, stream)
        a.free(b)             # the freed block (and its whole segment) is cached for `stream` only
    seen = {}
    for pool in a.pools.values():
        for seg in pool.segments:
            seen.setdefault(seg.stream, []).append(seg)
    for size, stream in reqs:
        b = a.malloc(size, stream)
        assert b.segment.stream == stream
        assert b.segment in seen.get(stream, [b.segment]) or b.segment not in sum(seen.values(), [])


# ---------------------------------------------------------------- the trace transform ----------
from sanitizer.place.replay import FOREIGN_BASE, place_events  # noqa: E402

TRACE_OP = st.one_of(
    st.tuples(st.just("alloc"), SIZES, STREAMS, st.sampled_from([None, "symm"])),
    st.tuples(st.just("free"), st.integers(0, 10**6)),
    st.tuples(st.just("record"), st.integers(0, 10**6), STREAMS),
    st.tuples(st.just("done"), st.integers(0, 10**6)),
    st.tuples(st.just("use"), st.integers(0, 10**6), st.integers(0, 10**6)),
)


@settings(max_examples=120, deadline=None)
@given(ops=st.lists(TRACE_OP, max_size=50), data=st.data())
def test_placed_traces_never_overlap_live_blocks_and_buffers_follow_their_block(ops, data):
    """Random CPU-like traces (addresses reused at will, as the CPU allocator does)."""
    events, live, held, nid = [], {}, [], 0
    uses = []                 # (block, offset) of each launch, in order (place keeps no unknown field)
    cpu_addrs = st.sampled_from([0x1000, 0x1000 + 4096, 0x50000, 0x900000])
    for op in ops:
        if op[0] == "alloc":
            _, size, stream, pool = op
            addr = data.draw(cpu_addrs)
            if any(a < addr + max(size, 1) and addr < a + max(s, 1) for a, s in live.values()):
                continue          # a CPU allocator does not hand out overlapping live blocks
            nid += 1
            if pool:
                events.append({"ev": "scope", "name": "symm", "enter": True, "pool": pool, "comm": "tp"})
            events.append({"ev": "alloc", "id": nid, "addr": addr, "size": size, "stream": stream, "pool": "default"})
            if pool:
                events.append({"ev": "scope", "name": "symm", "enter": False})
            live[nid] = (addr, size)
        elif op[0] == "free" and live:
            bid = sorted(live)[op[1] % len(live)]
            del live[bid]
            events.append({"ev": "free", "id": bid})
            held.append(bid)
        elif op[0] == "record" and live:
            events.append({"ev": "record_stream", "id": sorted(live)[op[1] % len(live)], "stream": op[2]})
        elif op[0] == "done" and held:
            events.append({"ev": "free_done", "id": held.pop(op[1] % len(held))})
        elif op[0] == "use" and live:
            bid = sorted(live)[op[1] % len(live)]
            a, s = live[bid]
            off = op[2] % max(s, 1)
            events.append({"ev": "launch", "stream": 0, "writes": [[a + off, 1]]})
            uses.append((bid, off))
    out, stats = place_events({}, list(enumerate(events, 2)), AllocatorConfig())
    placed, model_live, held_live, streams = {}, {}, {}, {}
    checks = iter(uses)
    for e in out:
        if e["ev"] == "alloc":
            lo, hi = e["addr"], e["addr"] + max(e["size"], 1)
            taken = list(model_live.values()) + list(held_live.values())
            assert all(hi <= a or b <= lo for a, b in taken), "placed over a live or held block"
            model_live[e["id"]] = (lo, hi)
            placed[e["id"]] = e["addr"]
            streams[e["id"]] = {e["stream"]}
        elif e["ev"] == "record_stream":
            streams[e["id"]].add(e["stream"])
        elif e["ev"] == "free":
            rng = model_live.pop(e["id"])
            if len(streams[e["id"]]) > 1:        # recorded on another stream: held until free_done
                held_live[e["id"]] = rng
        elif e["ev"] == "free_done":
            held_live.pop(e["id"], None)
        elif e["ev"] == "launch":
            bid, off = next(checks)
            assert e["writes"][0][0] == placed[bid] + off < FOREIGN_BASE
    assert stats.allocs == sum(1 for e in events if e["ev"] == "alloc")
    assert next(checks, None) is None                    # every launch came out
