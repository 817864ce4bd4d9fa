#!/usr/bin/env python3
"""Synthetic decode trace in schema 1 (docs/trace-format.md), for benchmarks and checks.

What one rank of a tensor-parallel DeepSeek-style decode server records, step after step:

- a prologue: weights and the KV cache in the default pool, the SGLang symmetric pool's
  preallocated segment registered as a window of communicator "tp";
- per step: `step`, the input ids copied in, the embedding, 60 layers, the final norm, the LM head
  with an all-gather of the vocabulary shards, sampling, and a host sync on the compute stream
  (`.tolist()` of the sampled ids);
- per layer: norm and attention activations in the default pool; the attention output and the MoE
  output allocated inside a `scope` "symm" (so in the window); each all-reduced on the communication
  stream with the usual fence: compute records E, comm waits E, coll, comm records E2, compute
  waits E2; the shared-expert output added on the comm stream, protected with `record_stream` and
  freed at once, its `free_done` seen at the next allocation (when the caching allocator polls its
  events); declared reads and writes on every launch (weights, KV cache slices, activations).

Addresses come from a small model of the CUDA caching allocator (sizes rounded to 512 B, small
pool <= 1 MiB carved from 2 MiB segments, large pool from 20 MiB segments, freed blocks reused per
stream and size, lowest address first, a block freed with `record_stream` held until `free_done`),
so after the first step every address is a reused one, as in a real server. The token count moves
between CUDA-graph-like batch buckets every few dozen steps, so block sizes change now and then.

The trace is clean by construction under `--peer-completion local`. `--inject N` plants N hazards
(in distinct layers, kinds taken in turn) and writes what the engine must report to
`OUT/expected.json` (1-based trace lines, header = line 1):

  missing-record-stream  shared-expert block freed without record_stream while the comm stream
                         still reads it                      -> free-in-flight
  collision              the same, and the freed address handed out again at once and written
                         on the compute stream               -> free-in-flight, reuse-in-flight,
                                                                unordered-access
  read-before-wait       the compute stream reads the attention output between the all-reduce
                         and the wait on its event           -> unordered-access
  transient-in-window    the reference case: a compute transient allocated inside the symm scope
                                                             -> transient-in-window (per site)

Every rank gets the same injections (a code bug runs on every rank), so window offsets stay
symmetric. Deterministic for a given --seed. Run with --help for the options.

`--mix SPEC` writes another program instead, with the share of each event kind given (issue 30:
traces from other generators ran slower than this one's). SPEC is a named mix (MIXES below) or
counts per repeating unit, `alloc=10,free=10,scope=4,launch=4,record=4,wait=4,coll=2,...`, and
optional `sites=N` (distinct call sites), `streams=N` (the compute stream and N-1 communication
streams the collectives take in turn), `events=N` (distinct CUDA event ids). Each unit allocates
activations and the collectives' buffers (inside `scope`s when there are scopes: in the window),
writes them with launches, fences each collective it can (record/wait on both sides, as the decode
layer does), and frees as many blocks as it allocated; see MixRank. A step of about 3,400 events
starts with `step` and ends with a host `sync`. Clean by construction; `--inject` plants the same
kinds of hazard, in units (the collision's re-allocated block lies in the window and no collective
touches it: a transient-in-window of its own, expected too).
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import os
import random
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # sanitizer.trace.binary, for --format binary

GENERATOR_VERSION = 2   # 2: binary traces intern call sites, ops and shapes (format version 2)

MiB = 1 << 20
GiB = 1 << 30

# Model shape (DeepSeek-V3 at TP 8): what the sizes below are made of.
HIDDEN = 7168
HEADS = 128 // 8                  # attention heads per rank
QK_DIM, V_DIM = 192, 128
Q_LORA, KV_LORA_ROPE = 1536, 576  # fused q_a / kv_a projection output
N_EXPERTS, TOP_K, MOE_INTER = 256, 8, 2048
VOCAB = 129280
LAYERS = 60
BF16, FP32, I64, I32 = 2, 4, 8, 4
TOKEN_BUCKETS = (48, 56, 64, 64, 64, 72, 80)   # 64 most of the time
BUCKET_STEPS = (20, 60)                        # a batch size lasts this many steps
CONTEXT_PER_TOKEN = 2048                       # tokens of context each request has in the KV cache

COMPUTE, COMM = 1, 2              # stream ids (ints, as torch and torch.cuda._sanitizer use)
COMM_NAME = "tp"
DEFAULT, SYMM = "default", "symm"

SMALL_LIMIT = 1 * MiB
SMALL_SEGMENT = 2 * MiB
LARGE_SEGMENT = 20 * MiB
LARGE_WHOLE_SLACK = 1 * MiB       # the large pool hands out a whole block when <= this remains
SYMM_PREALLOC = 4 * GiB           # SGLANG_SYMM_MEM_PREALLOC_GB_SIZE default

SITE = {
    "ids": "sglang/srt/model_executor/forward_batch_info.py:412:init_new",
    "embed": "sglang/srt/layers/vocab_parallel_embedding.py:480:forward",
    "norm": "sglang/srt/layers/layernorm.py:98:forward_cuda",
    "qkv_a": "sglang/srt/models/deepseek_v2.py:1190:forward_absorb_prepare",
    "q": "sglang/srt/models/deepseek_v2.py:1203:forward_absorb_prepare",
    "kv_set": "sglang/srt/mem_cache/memory_pool.py:1301:set_mla_kv_buffer",
    "attn": "sglang/srt/layers/attention/flashmla_backend.py:377:forward_decode",
    "o_proj": "sglang/srt/models/deepseek_v2.py:1278:forward_absorb_core",
    "allreduce": "sglang/srt/distributed/communication_op.py:14:tensor_model_parallel_all_reduce",
    "residual": "sglang/srt/layers/layernorm.py:91:forward_cuda",
    "gate": "sglang/srt/models/deepseek_v2.py:311:forward",
    "topk": "sglang/srt/layers/moe/topk.py:560:select_experts",
    "shared": "sglang/srt/models/deepseek_v2.py:471:_forward_shared_experts",
    "moe_inter": "sglang/srt/layers/moe/fused_moe_triton/fused_moe.py:1318:fused_experts_impl",
    "moe_out": "sglang/srt/layers/moe/fused_moe_triton/fused_moe.py:1333:fused_experts_impl",
    "shared_add": "sglang/srt/models/deepseek_v2.py:522:forward_normal_dual_stream",
    "lm_head": "sglang/srt/layers/logits_processor.py:702:_get_logits",
    "gather": "sglang/srt/distributed/parallel_state.py:620:all_gather",
    "sample": "sglang/srt/layers/sampler.py:104:forward",
    "weights": "sglang/srt/model_loader/loader.py:372:load_weights",
    "kv_cache": "sglang/srt/mem_cache/memory_pool.py:1196:_create_buffers",
    "symm_scope": "sglang/srt/distributed/device_communicators/pynccl_allocator.py:135:__enter__",
    # Injected hazards get sites of their own, so a report can be checked against them.
    "hazard_tmp": "sglang/srt/models/deepseek_v2.py:530:forward_normal_dual_stream",
    "hazard_read": "sglang/srt/models/deepseek_v2.py:1290:forward_absorb_core",
    "hazard_transient": "sglang/srt/layers/mhc.py:2743:mhc_combine",
}

#: The optional fields --lean leaves out (docs/trace-format.md, "Fields every event may carry": all optional).
LEAN_DROPS = ("site", "op", "shape", "dtype", "requested", "stack")

HAZARD_KINDS = ("missing-record-stream", "collision", "read-before-wait", "transient-in-window")
HAZARD_RULES = {
    "missing-record-stream": ("free-in-flight",),
    "collision": ("free-in-flight", "reuse-in-flight", "unordered-access"),
    "read-before-wait": ("unordered-access",),
    "transient-in-window": ("transient-in-window",),
}


def round_size(size: int) -> int:
    """The caching allocator's rounding: 512 B minimum, multiples of 512 B."""
    return 512 if size < 512 else (size + 511) // 512 * 512


class SegmentSource:
    """Where a pool's segments come from (cudaMalloc, ncclMemAlloc): a range of virtual addresses
    handed out upwards with occasional gaps, as a driver does."""

    def __init__(self, base: int, rng: random.Random):
        self.next = base
        self.rng = rng

    def take(self, size: int) -> int:
        addr = self.next
        self.next += (size + 2 * MiB - 1) // (2 * MiB) * (2 * MiB) + self.rng.choice((0, 0, 0, 2 * MiB))
        return addr


class Placer:
    """Where the caching allocator puts blocks of one pool. Enough of CUDACachingAllocator for a
    realistic address stream: rounding, small/large pools, segment sizes, per-stream reuse of freed
    blocks lowest address first, whole large blocks when little would remain. Not modelled:
    splitting of reused blocks and merging of free neighbours (the decode loop reuses equal sizes)."""

    def __init__(self, pool: str, source: SegmentSource, on_segment):
        self.pool = pool
        self.source = source
        self.on_segment = on_segment          # called (addr, size) for every new segment
        self.free: dict[tuple, list] = {}     # (stream, is_small) -> sorted [(size, addr)]
        self.tail: dict[tuple, list] = {}     # (stream, is_small) -> [next addr, end] of the newest segment

    def add_segment(self, stream, addr: int, size: int, small: bool) -> None:
        """A segment obtained elsewhere (a preallocation) becomes the pool's carving space."""
        self.tail[(stream, small)] = [addr, addr + size]

    def malloc(self, size: int, stream) -> tuple[int, int]:
        """Returns (addr, block size)."""
        rounded = round_size(size)
        small = rounded <= SMALL_LIMIT
        key = (stream, small)
        free = self.free.get(key)
        if free:
            i = bisect.bisect_left(free, (rounded, 0))
            if i < len(free):
                bsize, addr = free[i]
                if bsize == rounded or (not small and bsize - rounded <= LARGE_WHOLE_SLACK):
                    del free[i]
                    return addr, bsize
        tail = self.tail.get(key)
        if tail is None or tail[1] - tail[0] < rounded:
            if small:
                seg = SMALL_SEGMENT
            else:
                seg = LARGE_SEGMENT if rounded < 10 * MiB else (rounded + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)
            addr = self.source.take(seg)
            self.on_segment(self.pool, addr, seg)
            tail = self.tail[key] = [addr, addr + seg]
        addr = tail[0]
        remaining = tail[1] - addr - rounded
        # Small pool splits when >= 512 B remain; large when > 1 MiB remains, else whole block.
        if small or remaining > LARGE_WHOLE_SLACK:
            tail[0] += rounded
            return addr, rounded
        tail[0] = tail[1]
        return addr, rounded + remaining

    def release(self, addr: int, bsize: int, stream) -> None:
        bisect.insort(self.free.setdefault((stream, bsize <= SMALL_LIMIT), []), (bsize, addr))

    def take_back(self, addr: int, bsize: int, stream) -> None:
        """Hand out exactly this freed block again (the injected collision)."""
        self.free[(stream, bsize <= SMALL_LIMIT)].remove((bsize, addr))


class TraceWriter:
    """Buffers encoded lines and writes them in large chunks; stops at exactly `limit` events."""

    def __init__(self, path: Path, header: dict, limit: int, compresslevel: int | None, lean: bool = False,
                 fmt: str = "jsonl"):
        self.path = path
        self.limit = limit
        self.lean = lean
        self.binary = fmt == "binary"
        self.stream = (gzip.open(path, "wb", compresslevel=compresslevel) if compresslevel
                       else open(path, "wb", buffering=1 << 22))
        self.buf: list = []      # encoded lines, or (binary) the events, encoded a frame at a time
        self.events = 0          # events emitted (some may lie past the limit)
        self.written = 0         # events in the file
        self.t = 1_000_000_000
        if self.binary:
            from sanitizer.trace import binary
            self.encode_frames = binary.encode_frames
            self.values = binary.ValueTable()    # version 2: call sites, ops, shapes written once, as capture does
            self.stream.write(binary.signature_and_header(header))
        else:
            self.stream.write(orjson.dumps(header) + b"\n")

    @property
    def next_line(self) -> int:
        return self.events + 2   # line of the next event (header = line 1)

    @property
    def full(self) -> bool:
        return self.events >= self.limit

    def emit(self, ev: dict) -> None:
        if self.lean:
            for key in LEAN_DROPS:
                ev.pop(key, None)
        else:
            self.t += 900 + (self.events * 7919) % 1300   # plausible ns gaps, no RNG call per event
            ev["t"] = self.t
        self.buf.append(ev if self.binary else orjson.dumps(ev, option=orjson.OPT_APPEND_NEWLINE))
        self.events += 1
        if len(self.buf) >= 4096:   # orjson.dumps results hold ~4 KiB each while alive
            self.flush()

    def flush(self) -> None:
        keep = self.buf[: self.limit - self.written]     # the program runs on to a layer's end
        self.stream.write(self.encode_frames(keep, self.values) if self.binary else b"".join(keep))
        self.written += len(keep)
        self.buf.clear()

    def close(self) -> int:
        """Writes what is buffered up to the limit; returns the number of events in the file."""
        self.flush()
        self.stream.close()
        return self.written


class DecodeRank:
    """Emits one rank's decode loop into a TraceWriter."""

    def __init__(self, rank: int, writer: TraceWriter, seed: int,
                 hazards: dict, stacks: bool):
        self.rank = rank
        self.w = writer
        self.emit = writer.emit
        self.hazards = hazards               # (step, layer) -> kind
        self.expected: list[dict] = []
        self.stacks = stacks
        self.shape_rng = random.Random(seed)                 # same on every rank: same program
        addr_rng = random.Random(seed * 1000 + rank + 1)     # per process: its own virtual addresses
        self.default = Placer(DEFAULT, SegmentSource(0x7F0000000000 + addr_rng.randrange(1 << 12) * GiB // 4,
                                                     addr_rng), self._segment)
        self.symm_source = SegmentSource(0x7E0000000000 + addr_rng.randrange(1 << 10) * GiB, addr_rng)
        self.symm = Placer(SYMM, self.symm_source, self._segment)
        self.unregistered: list[tuple[int, int]] = []        # symm segments awaiting the scope exit
        self.next_id = 1
        self.next_cid = 1
        self.seq = 0
        self.step_no = 0
        self.pending_free_done: list[int] = []
        self.blocks: dict[int, tuple] = {}                   # id -> (addr, bsize, placer)
        self.event_ids = [0x5600_0000_1000 + 0x40 * i for i in range(4)]   # cudaEvent_t values, reused
        self.weights: dict[str, tuple] = {}

    # -- primitives ------------------------------------------------------------------------------
    def _segment(self, pool, addr, size):
        self.emit({"ev": "segment", "addr": addr, "size": size, "pool": pool})
        if pool == SYMM:
            self.unregistered.append((addr, size))

    def alloc(self, nbytes: int, role: str, shape, dtype="bfloat16", pool=DEFAULT, reuse=None) -> tuple:
        """Returns the block as (id, addr, nbytes)."""
        if self.pending_free_done:          # the allocator polls its events at every malloc
            for bid in self.pending_free_done:
                self.emit({"ev": "free_done", "id": bid})
                addr, bsize, placer = self.blocks.pop(bid)
                placer.release(addr, bsize, COMPUTE)
            self.pending_free_done.clear()
        placer = self.symm if pool == SYMM else self.default
        if reuse is not None:
            addr, bsize = reuse
            placer.take_back(addr, bsize, COMPUTE)
        else:
            addr, bsize = placer.malloc(nbytes, COMPUTE)
        bid = self.next_id
        self.next_id += 1
        self.blocks[bid] = (addr, bsize, placer)
        ev = {"ev": "alloc", "id": bid, "addr": addr, "size": bsize, "stream": COMPUTE, "pool": pool,
              "requested": nbytes, "site": SITE[role], "shape": shape, "dtype": dtype}
        if self.stacks:
            ev["stack"] = [SITE[role], "sglang/srt/models/deepseek_v2.py:2090:forward",
                           "sglang/srt/model_executor/model_runner.py:1850:forward_decode"]
        self.emit(ev)
        return bid, addr, nbytes

    def free(self, block, *, record_stream=None) -> None:
        bid = block[0]
        if record_stream is not None:
            self.emit({"ev": "record_stream", "id": bid, "stream": record_stream})
        self.emit({"ev": "free", "id": bid})
        if record_stream is not None:
            self.pending_free_done.append(bid)   # held until the allocator sees the stream finish
        else:
            addr, bsize, placer = self.blocks.pop(bid)
            placer.release(addr, bsize, COMPUTE)

    def launch(self, op: str, role: str, reads, writes, stream=COMPUTE) -> None:
        self.emit({"ev": "launch", "stream": stream, "op": op, "site": SITE[role],
                   "reads": [[b[1], b[2]] for b in reads], "writes": [[b[1], b[2]] for b in writes]})

    def coll(self, op: str, role: str, bufs, stream) -> None:
        self.seq += 1
        self.emit({"ev": "coll", "cid": self.next_cid, "comm": COMM_NAME, "seq": self.seq, "op": op,
                   "stream": stream, "site": SITE[role],
                   "bufs": [{"addr": b[1], "size": b[2], "access": a} for b, a in bufs]})
        self.next_cid += 1

    def scope(self, enter: bool) -> None:
        self.emit({"ev": "scope", "name": "symm", "enter": enter, "pool": SYMM, "comm": COMM_NAME,
                   "site": SITE["symm_scope"]})
        if not enter and self.unregistered:
            # SymmetricMemoryContext.__exit__ registers the pool's new segments as windows.
            for addr, size in self.unregistered:
                self.emit({"ev": "window", "addr": addr, "size": size, "comm": COMM_NAME})
            self.unregistered.clear()

    def record(self, event: int, stream) -> None:
        self.emit({"ev": "record", "event": event, "stream": stream})

    def wait(self, event: int, stream) -> None:
        self.emit({"ev": "wait", "event": event, "stream": stream})

    def expect(self, rule: str, line: int, kind: str, site: str | None = None) -> None:
        self.expected.append({"rule": rule, "rank": self.rank, "line": line, "hazard": kind,
                              "step": self.step_no, **({"site": site} if site else {})})

    # -- the program -----------------------------------------------------------------------------
    def prologue(self) -> None:
        w = self.weights
        for layer in range(LAYERS):
            w[layer] = {
                "norm1": self.alloc(HIDDEN * BF16, "weights", [HIDDEN]),
                "qkv_a": self.alloc(HIDDEN * (Q_LORA + KV_LORA_ROPE) * BF16, "weights", [Q_LORA + KV_LORA_ROPE, HIDDEN]),
                "q_b": self.alloc(Q_LORA * HEADS * QK_DIM * BF16, "weights", [HEADS * QK_DIM, Q_LORA]),
                "o": self.alloc(HEADS * V_DIM * HIDDEN * BF16, "weights", [HIDDEN, HEADS * V_DIM]),
                "norm2": self.alloc(HIDDEN * BF16, "weights", [HIDDEN]),
                "gate": self.alloc(N_EXPERTS * HIDDEN * FP32, "weights", [N_EXPERTS, HIDDEN], "float32"),
                "experts": self.alloc(N_EXPERTS * 3 * HIDDEN * MOE_INTER // 8, "weights",
                                      [N_EXPERTS, 3 * MOE_INTER // 8, HIDDEN], "float8_e4m3fn"),
                "shared": self.alloc(3 * HIDDEN * MOE_INTER // 8 * BF16, "weights", [3 * MOE_INTER // 8, HIDDEN]),
            }
        w["embed"] = self.alloc(VOCAB // 8 * HIDDEN * BF16, "weights", [VOCAB // 8, HIDDEN])
        w["final_norm"] = self.alloc(HIDDEN * BF16, "weights", [HIDDEN])
        w["lm_head"] = self.alloc(VOCAB // 8 * HIDDEN * BF16, "weights", [VOCAB // 8, HIDDEN])
        self.kv_per_layer = 256 * 1024 * KV_LORA_ROPE * BF16    # 256k token slots per layer
        self.kv = self.alloc(self.kv_per_layer * LAYERS, "kv_cache", [LAYERS, 256 * 1024, KV_LORA_ROPE])
        # SGLang preallocates the symmetric pool (one large segment) and registers it at once.
        addr = self.symm_source.take(SYMM_PREALLOC)
        self._segment(SYMM, addr, SYMM_PREALLOC)
        self.symm.add_segment(COMPUTE, addr, SYMM_PREALLOC, small=False)
        self.scope(True)
        self.scope(False)
        self.emit({"ev": "sync"})

    def run(self) -> None:
        self.prologue()
        rng = self.shape_rng
        tokens = 64
        change_at = 0
        n = 0
        while not self.w.full:
            if n == change_at:
                tokens = rng.choice(TOKEN_BUCKETS)
                change_at = n + rng.randint(*BUCKET_STEPS)
            self.step(n, tokens)
            n += 1

    def step(self, n: int, T: int) -> None:
        self.step_no = n
        w = self.weights
        self.emit({"ev": "step", "n": n, "phase": "decode", "tokens": T})
        ids = self.alloc(T * I64, "ids", [T], "int64")
        self.launch("aten::copy_", "ids", (), (ids,))
        x = self.alloc(T * HIDDEN * BF16, "embed", [T, HIDDEN])
        self.launch("embedding", "embed", (ids, w["embed"]), (x,))
        self.free(ids)
        for layer in range(LAYERS):
            if self.w.full:
                return
            x = self.layer(n, layer, T, x)
        h = self.alloc(T * HIDDEN * BF16, "norm", [T, HIDDEN])
        self.launch("rmsnorm", "norm", (x, w["final_norm"]), (h,))
        self.free(x)
        logits = self.alloc(T * (VOCAB // 8) * BF16, "lm_head", [T, VOCAB // 8])
        self.launch("gemm", "lm_head", (h, w["lm_head"]), (logits,))
        self.free(h)
        gathered = self.alloc(T * VOCAB * BF16, "gather", [T, VOCAB])
        # pynccl collectives run on the current (compute) stream: no fence needed.
        self.coll("all_gather", "gather", ((logits, "r"), (gathered, "w")), COMPUTE)
        self.free(logits)
        next_ids = self.alloc(T * I64, "sample", [T], "int64")
        self.launch("sampling", "sample", (gathered,), (next_ids,))
        self.free(gathered)
        self.emit({"ev": "sync", "stream": COMPUTE})          # next_ids.tolist()
        self.free(next_ids)

    def layer(self, n: int, layer: int, T: int, x):
        wl = self.weights[layer]
        hazard = self.hazards.get((n, layer))
        e1, e2, e3, e4 = self.event_ids
        act = T * HIDDEN * BF16
        # attention
        h = self.alloc(act, "norm", [T, HIDDEN])
        self.launch("rmsnorm", "norm", (x, wl["norm1"]), (h,))
        qkv_a = self.alloc(T * (Q_LORA + KV_LORA_ROPE) * BF16, "qkv_a", [T, Q_LORA + KV_LORA_ROPE])
        self.launch("gemm", "qkv_a", (h, wl["qkv_a"]), (qkv_a,))
        self.free(h)
        q = self.alloc(T * HEADS * QK_DIM * BF16, "q", [T, HEADS, QK_DIM])
        self.launch("gemm", "q", (qkv_a, wl["q_b"]), (q,))
        kv_base = self.kv[1] + layer * self.kv_per_layer
        slot = (n * T) % (200 * 1024)
        kv_slot = (None, kv_base + slot * KV_LORA_ROPE * BF16, T * KV_LORA_ROPE * BF16)
        kv_ctx = (None, kv_base, min(T * CONTEXT_PER_TOKEN, 256 * 1024) * KV_LORA_ROPE * BF16)
        self.launch("set_mla_kv_buffer", "kv_set", (qkv_a,), (kv_slot,))
        self.free(qkv_a)
        attn = self.alloc(T * HEADS * V_DIM * BF16, "attn", [T, HEADS, V_DIM])
        self.launch("flash_mla_decode", "attn", (q, kv_ctx), (attn,))
        self.free(q)
        self.scope(True)
        o = self.alloc(act, "o_proj", [T, HIDDEN], pool=SYMM)
        self.scope(False)
        self.launch("gemm", "o_proj", (attn, wl["o"]), (o,))
        self.free(attn)
        self.record(e1, COMPUTE)
        self.wait(e1, COMM)
        self.coll("all_reduce", "allreduce", ((o, "rw"),), COMM)
        self.record(e2, COMM)
        if hazard == "read-before-wait":
            # o read on the compute stream before the wait: the all-reduce may still write it.
            self.expect("unordered-access", self.w.next_line, hazard)
            self.launch("aten::abs_max", "hazard_read", (o,), ())
        self.wait(e2, COMPUTE)
        x2 = self.alloc(act, "residual", [T, HIDDEN])
        self.launch("add", "residual", (x, o), (x2,))
        self.free(o)
        self.free(x)
        # MoE
        h2 = self.alloc(act, "norm", [T, HIDDEN])
        self.launch("rmsnorm", "norm", (x2, wl["norm2"]), (h2,))
        logits = self.alloc(T * N_EXPERTS * FP32, "gate", [T, N_EXPERTS], "float32")
        self.launch("gemm", "gate", (h2, wl["gate"]), (logits,))
        topk = self.alloc(T * TOP_K * (I32 + FP32), "topk", [T, TOP_K, 2], "int32")
        self.launch("topk_softmax", "topk", (logits,), (topk,))
        self.free(logits)
        inter = self.alloc(T * TOP_K * 2 * (MOE_INTER // 8) * BF16, "moe_inter", [T * TOP_K, 2 * MOE_INTER // 8])
        shared = self.alloc(act, "shared", [T, HIDDEN])
        self.launch("shared_experts", "shared", (h2, wl["shared"]), (shared,))
        self.scope(True)
        transient = None
        if hazard == "transient-in-window":
            # The reference case: compute inside the scope puts its transient in the window.
            transient = self.alloc(T * HIDDEN * FP32, "hazard_transient", [T, HIDDEN], "float32", pool=SYMM)
            self.launch("einsum", "hazard_transient", (h2, topk), (transient,))
        moe_out = self.alloc(act, "moe_out", [T, HIDDEN], pool=SYMM)
        self.scope(False)
        self.launch("fused_moe_gate_up", "moe_inter", (h2, topk, wl["experts"]), (inter,))
        self.launch("fused_moe_down", "moe_out", (inter, topk, wl["experts"]) + ((transient,) if transient else ()),
                    (moe_out,))
        self.free(inter)
        self.free(topk)
        self.free(h2)
        self.record(e3, COMPUTE)
        self.wait(e3, COMM)
        self.launch("add", "shared_add", (shared, moe_out), (moe_out,), stream=COMM)
        collided = None
        if hazard in ("missing-record-stream", "collision"):
            # shared dropped without record_stream while the comm stream still reads it.
            self.expect("free-in-flight", self.w.next_line, hazard)
            addr, bsize, _ = self.blocks[shared[0]]
            self.free(shared)
            if hazard == "collision":
                # ... and the allocator hands the same address out again at once.
                self.expect("reuse-in-flight", self.w.next_line, hazard)
                collided = self.alloc(act, "hazard_tmp", [T, HIDDEN], reuse=(addr, bsize))
                self.expect("unordered-access", self.w.next_line, hazard)
                self.launch("aten::zero_", "hazard_tmp", (), (collided,))
        else:
            self.free(shared, record_stream=COMM)
        self.coll("all_reduce", "allreduce", ((moe_out, "rw"),), COMM)
        if transient:
            # freed after the layer's all-reduce was issued: a transient a collective could
            # write (docs/hazard-model.md, "When a window transient is a hazard"), in every mix
            self.expect("transient-in-window", self.w.next_line, hazard, SITE["hazard_transient"])
            self.free(transient)
        self.record(e4, COMM)
        self.wait(e4, COMPUTE)
        if collided:
            self.free(collided)
        x3 = self.alloc(act, "residual", [T, HIDDEN])
        self.launch("add", "residual", (x2, moe_out), (x3,))
        self.free(moe_out)
        self.free(x2)
        return x3


# -- other mixes (--mix) ---------------------------------------------------------------------------
#: Named mixes for --mix: events of each kind in one repeating unit (and the mix's parameters).
#: "alloc-heavy" is issue 30's trace from another generator: alloc and free 25% each, scope 10%,
#: launch 10%, record and wait 10% each, collectives 5%, 3 distinct call sites. The issue leaves
#: 5% unnamed; here it is record_stream and free_done (2.5% each), the one pair of kinds that
#: capture writes and that table leaves out. "decode" is the layer model above (the default).
MIXES = {
    "alloc-heavy": "alloc=10,free=10,scope=4,launch=4,record=4,wait=4,coll=2,record_stream=1,free_done=1,sites=3",
}
MIX_KINDS = ("alloc", "free", "scope", "launch", "record", "wait", "coll", "record_stream", "free_done")
MIX_PARAMS = {"sites": 3, "streams": 2, "events": 4, "ids": "int", "fence": "coll"}
#: Call sites a mix draws from (the first `sites`), all in the decode model's code.
MIX_SITES = ("o_proj", "allreduce", "norm", "qkv_a", "attn", "moe_out", "gate", "topk", "shared", "lm_head",
             "embed", "sample", "q", "kv_set", "residual", "moe_inter")
MIX_STEP_EVENTS = 3400            # a step of the mix: about as many events as a decode step


def parse_mix(spec: str) -> dict:
    """A --mix value -> {kind: count per unit, ..., "sites", "streams", "events", "name"}; ValueError
    saying why not."""
    name = spec
    spec = MIXES.get(spec, spec)
    mix = {k: 0 for k in MIX_KINDS}
    mix.update(MIX_PARAMS)
    for part in spec.split(","):
        key, eq, value = part.strip().partition("=")
        if not eq or key not in mix:
            raise ValueError(f"--mix: {part.strip()!r} is not KIND=COUNT (kinds: {', '.join(MIX_KINDS)}; "
                             f"parameters: {', '.join(MIX_PARAMS)}; named mixes: {', '.join(MIXES)}, decode)")
        if key == "fence":
            if value not in ("coll", "launch"):
                raise ValueError("--mix: fence must be coll (records and waits fence the collectives) or launch "
                                 "(they fence launches on the other streams; collectives on the compute stream)")
            mix[key] = value
            continue
        if key == "ids":
            if value not in ("int", "capture"):
                raise ValueError("--mix: ids must be int (stream 1, 2, ...; events as ints) or capture "
                                 "(the strings capture writes: cuda:0, cuda:0:s1, ...; e<hex>)")
            mix[key] = value
            continue
        try:
            mix[key] = int(value)
        except ValueError:
            raise ValueError(f"--mix: {key}={value!r} is not an integer") from None
        if mix[key] < 0:
            raise ValueError(f"--mix: {key} must be >= 0")
    if mix["free"] != mix["alloc"]:
        raise ValueError("--mix: free must equal alloc (each unit frees as many blocks as it allocates)")
    if mix["free_done"] != mix["record_stream"]:
        raise ValueError("--mix: free_done must equal record_stream (each such free is completed)")
    if mix["scope"] % 2:
        raise ValueError("--mix: scope must be even (an enter and an exit each)")
    if mix["record_stream"] > mix["alloc"] - min(mix["alloc"], mix["coll"]):
        raise ValueError("--mix: record_stream must be at most alloc - coll (activations freed with record_stream)")
    if mix["alloc"] + mix["launch"] + mix["coll"] + mix["record"] + mix["wait"] + mix["scope"] == 0:
        raise ValueError("--mix: a unit needs at least one event")
    if not 1 <= mix["sites"] <= len(MIX_SITES):
        raise ValueError(f"--mix: sites must be 1 to {len(MIX_SITES)}")
    if mix["streams"] < 1 or mix["events"] < 1:
        raise ValueError("--mix: streams and events must be >= 1")
    mix["name"] = name
    return mix


def mix_unit_size(mix: dict) -> int:
    return sum(mix[k] for k in MIX_KINDS)


class MixRank(DecodeRank):
    """One rank of a program with the event mix `mix` (parse_mix), unit after unit.

    A unit, with A allocs, L launches, C collectives, S scope events, R records, W waits, K
    record_streams (and as many free_dones), A frees:
    - the activations (A - C blocks, default pool), each allocated just before the launch that
      writes it (the launches left after the collectives' share split them in turn, reading the
      block carried from the last unit and a weight); a launch with no activation left updates the
      carried block in place;
    - per collective: its buffer allocated (inside a scope while scope pairs last, so in the symm
      window; a scope pair left over is an empty one), written by a launch if one is left, then,
      while records and waits last two each, fenced like the decode layer's all-reduce (compute
      records, the communication stream waits, the collective on it, it records, compute waits);
      a collective without a fence runs on the compute stream (pynccl's way);
    - the records and waits left over: compute records an event the next communication stream
      waits for (ordering that orders nothing new), records or waits alone after that;
    - the frees: the collectives' buffers, then every activation but the last (K of them with
      `record_stream` on a communication stream, their `free_done` at the next alloc, as the
      allocator polls), and the block carried from the last unit; the last activation is carried.
    Everything here is ordered (clean); --inject plants hazards in units that have a fenced
    collective in a scope."""

    def __init__(self, rank: int, writer: TraceWriter, seed: int, hazards: dict, stacks: bool, mix: dict):
        super().__init__(rank, writer, seed, hazards, stacks)
        self.mix = mix
        self.sites = [SITE[r] for r in MIX_SITES[: mix["sites"]]]
        self.site_turn = 0
        if mix["ids"] == "capture":   # the ids capture writes (sanitizer/capture/streams.py, cuda_hooks.py)
            self.compute = "cuda:0"
            self.comm_streams = [f"cuda:0:s{i}" for i in range(1, mix["streams"])] or [self.compute]
            self.event_ids = [f"e{0x5600_0000_1000 + 0x40 * i:x}" for i in range(mix["events"])]
        else:                         # small ints, as the decode model writes
            self.compute = COMPUTE
            self.comm_streams = list(range(COMM, COMM + mix["streams"] - 1)) or [COMPUTE]
            self.event_ids = [0x5600_0000_1000 + 0x40 * i for i in range(mix["events"])]
        self.comm_turn = 0
        self.event_turn = 0
        self.recorded: list = []
        self.units_per_step = max(1, MIX_STEP_EVENTS // mix_unit_size(mix))
        self.x = None

    def next_site(self) -> str:
        site = self.sites[self.site_turn % len(self.sites)]
        self.site_turn += 1
        return site

    def next_event(self) -> int:
        ev = self.event_ids[self.event_turn % len(self.event_ids)]
        self.event_turn += 1
        return ev

    def next_comm(self):
        s = self.comm_streams[self.comm_turn % len(self.comm_streams)]
        self.comm_turn += 1
        return s

    # The primitives with the mix's call sites (role names stay for the hazards' own sites).
    def m_alloc(self, nbytes, shape, pool=DEFAULT, role=None, reuse=None):
        site = SITE[role] if role else self.next_site()
        if self.pending_free_done:
            for bid in self.pending_free_done:
                self.emit({"ev": "free_done", "id": bid})
                addr, bsize, placer = self.blocks.pop(bid)
                placer.release(addr, bsize, COMPUTE)
            self.pending_free_done.clear()
        placer = self.symm if pool == SYMM else self.default
        if reuse is not None:
            addr, bsize = reuse
            placer.take_back(addr, bsize, COMPUTE)
        else:
            addr, bsize = placer.malloc(nbytes, COMPUTE)
        bid = self.next_id
        self.next_id += 1
        self.blocks[bid] = (addr, bsize, placer)
        ev = {"ev": "alloc", "id": bid, "addr": addr, "size": bsize, "stream": self.compute, "pool": pool,
              "requested": nbytes, "site": site, "shape": shape, "dtype": "bfloat16"}
        if self.stacks:
            ev["stack"] = [site, "sglang/srt/models/deepseek_v2.py:2090:forward",
                           "sglang/srt/model_executor/model_runner.py:1850:forward_decode"]
        self.emit(ev)
        return bid, addr, nbytes

    def m_launch(self, op, reads, writes, role=None, stream=None):
        self.emit({"ev": "launch", "stream": self.compute if stream is None else stream, "op": op, "site": SITE[role] if role else self.next_site(),
                   "reads": [[b[1], b[2]] for b in reads], "writes": [[b[1], b[2]] for b in writes]})

    def m_coll(self, bufs, stream):
        self.seq += 1
        self.emit({"ev": "coll", "cid": self.next_cid, "comm": COMM_NAME, "seq": self.seq, "op": "all_reduce",
                   "stream": stream, "site": self.next_site(),
                   "bufs": [{"addr": b[1], "size": b[2], "access": a} for b, a in bufs]})
        self.next_cid += 1

    def scope(self, enter: bool) -> None:
        self.emit({"ev": "scope", "name": "symm", "enter": enter, "pool": SYMM, "comm": COMM_NAME,
                   "site": self.next_site()})
        if not enter and self.unregistered:
            for addr, size in self.unregistered:
                self.emit({"ev": "window", "addr": addr, "size": size, "comm": COMM_NAME})
            self.unregistered.clear()

    def m_record(self, stream) -> int:
        ev = self.next_event()
        self.record(ev, stream)
        self.recorded.append(ev)
        return ev

    def prologue(self) -> None:
        w = self.weights
        for i in range(4):
            w[i] = self.m_alloc(HIDDEN * HIDDEN * BF16, [HIDDEN, HIDDEN])
        addr = self.symm_source.take(SYMM_PREALLOC)
        self._segment(SYMM, addr, SYMM_PREALLOC)
        self.symm.add_segment(COMPUTE, addr, SYMM_PREALLOC, small=False)
        self.scope(True)
        self.scope(False)
        self.emit({"ev": "sync"})

    def run(self) -> None:
        self.prologue()
        rng = self.shape_rng
        tokens = 64
        change_at = 0
        n = 0
        while not self.w.full:
            if n == change_at:
                tokens = rng.choice(TOKEN_BUCKETS)
                change_at = n + rng.randint(*BUCKET_STEPS)
            self.step_no = n
            self.emit({"ev": "step", "n": n, "phase": "decode", "tokens": tokens})
            if self.x is None:
                self.x = self.m_alloc(tokens * HIDDEN * BF16, [tokens, HIDDEN])
                self.m_launch("embedding", (), (self.x,))
            for u in range(self.units_per_step):
                if self.w.full:
                    return
                self.unit(n, u, tokens)
            self.emit({"ev": "sync", "stream": self.compute})
            n += 1

    def unit(self, n: int, u: int, T: int) -> None:
        m = self.mix
        hazard = self.hazards.get((n, u))
        A, L, C, S, R, W, K = m["alloc"], m["launch"], m["coll"], m["scope"], m["record"], m["wait"], m["record_stream"]
        pairs = S // 2
        fenced = min(C, R // 2, W // 2) if m["fence"] == "coll" else 0
        coll_allocs = min(A, C)
        n_act = A - coll_allocs
        coll_launches = min(L, C)
        act_launches = L - coll_launches
        x = self.x
        w = self.weights[u % len(self.weights)]
        act = T * HIDDEN * BF16
        records, waits = R, W
        # empty scopes first (scope pairs the collectives do not use)
        for _ in range(max(0, pairs - C)):
            self.scope(True)
            self.scope(False)
        # activations, each allocated just before the launch that writes it
        acts = []
        if act_launches == 0:
            for i in range(n_act):
                acts.append(self.m_alloc(act * (1 + i % 3), [T, HIDDEN * (1 + i % 3)]))
        else:
            prev = x
            for j in range(act_launches):
                mine = [self.m_alloc(act * (1 + i % 3), [T, HIDDEN * (1 + i % 3)])
                        for i in range(j, n_act, act_launches)]
                acts += mine
                if m["fence"] == "launch" and records >= 2 and waits >= 2:
                    # on another stream, fenced both ways: it sees what compute did, compute its work
                    records -= 2
                    waits -= 2
                    side = self.next_comm()
                    self.wait(self.m_record(self.compute), side)
                    self.m_launch("gemm", (prev, w), mine or (x,), stream=side)
                    self.wait(self.m_record(side), self.compute)
                else:
                    self.m_launch("gemm", (prev, w), mine or (x,))
                if mine:
                    prev = mine[-1]
        last = acts[-1] if acts else x
        # the collectives
        colls = []
        launches_left = coll_launches
        for k in range(C):
            buf = None
            transient = None
            if k < pairs:
                self.scope(True)
                if k == 0 and hazard == "transient-in-window" and k < fenced:
                    transient = self.m_alloc(T * HIDDEN * FP32, [T, HIDDEN], pool=SYMM, role="hazard_transient")
                    self.m_launch("einsum", (last,), (transient,), role="hazard_transient")
                if k < coll_allocs:
                    buf = self.m_alloc(act, [T, HIDDEN], pool=SYMM)
                self.scope(False)
            elif k < coll_allocs:
                buf = self.m_alloc(act, [T, HIDDEN])
            target = buf if buf is not None else x
            if launches_left:
                launches_left -= 1
                self.m_launch("gemm", (last,) + ((transient,) if transient else ()), (target,))
            if k < fenced:
                records -= 2
                waits -= 2
                comm = self.next_comm()
                e1 = self.m_record(self.compute)
                self.wait(e1, comm)
                self.m_coll(((target, "rw"),), comm)
                if transient:
                    # freed once the collective is issued: a collective could write it
                    # (docs/hazard-model.md, "When a window transient is a hazard")
                    self.expect("transient-in-window", self.w.next_line, hazard, SITE["hazard_transient"])
                    self.free(transient)
                collided = None
                if k == 0 and hazard == "read-before-wait":
                    self.expect("unordered-access", self.w.next_line, hazard)
                    self.m_launch("aten::abs_max", (target,), (), role="hazard_read")
                elif k == 0 and hazard in ("missing-record-stream", "collision") and buf is not None:
                    # the collective's buffer freed before the wait that orders the collective
                    self.expect("free-in-flight", self.w.next_line, hazard)
                    addr, bsize, _ = self.blocks[buf[0]]
                    self.free(buf)
                    buf = None
                    if hazard == "collision":
                        self.expect("reuse-in-flight", self.w.next_line, hazard)
                        collided = self.m_alloc(act, [T, HIDDEN], pool=SYMM, role="hazard_tmp", reuse=(addr, bsize))
                        self.expect("unordered-access", self.w.next_line, hazard)
                        self.m_launch("aten::zero_", (), (collided,), role="hazard_tmp")
                e2 = self.m_record(comm)
                self.wait(e2, self.compute)
                if collided:
                    # in the window, and no collective touches it: a transient of its own
                    self.expect("transient-in-window", self.w.next_line, hazard, SITE["hazard_tmp"])
                    self.free(collided)
            else:
                self.m_coll(((target, "rw"),), self.compute)
            if buf is not None:
                colls.append(buf)
        # records and waits left over: ordering that adds nothing new
        while records > 0 and waits > 0:
            records -= 1
            waits -= 1
            self.wait(self.m_record(self.compute), self.next_comm())
        while records > 0:
            records -= 1
            self.m_record(self.compute)
        while waits > 0:
            waits -= 1
            if self.recorded:
                self.wait(self.recorded[-1], self.compute)
            else:
                self.wait(self.m_record(self.compute), self.compute)
        # the frees: as many as the allocs
        for b in colls:
            self.free(b)
        freed = acts[:-1] + ([x] if acts else [])
        rs = K
        for b in freed:
            if rs:
                rs -= 1
                self.free(b, record_stream=self.comm_streams[-1])
            else:
                self.free(b)
        if acts:
            self.x = last
        self.recorded.clear()


def plan_hazards(count: int, seed: int, events: int, per_step: int = 3500, slots_per_step: int = LAYERS) -> dict:
    """(step, layer) -> kind for `count` distinct layers (mix: units) spread over the trace's steps."""
    if count <= 0:
        return {}
    steps = max(1, events // per_step - 1)        # about per_step events per step; stay inside
    slots = [(s, layer) for s in range(steps) for layer in range(slots_per_step)]
    if count > len(slots):
        raise SystemExit(f"--inject {count}: a trace of {events} events has only {len(slots)} layers to put hazards in")
    rng = random.Random(seed + 7)
    chosen = sorted(rng.sample(slots, count))
    order = list(range(count))
    rng.shuffle(order)
    return {slot: HAZARD_KINDS[order[i] % len(HAZARD_KINDS)] for i, slot in enumerate(chosen)}


def generate(out: Path, *, events: int, ranks: int = 1, seed: int = 1, inject: int = 0,
             gzip_level: int | None = None, stacks: bool = False, lean: bool = False, fmt: str = "jsonl",
             mix: str = "decode") -> dict:
    """Writes rank{r}.jsonl[.gz] (or, `fmt` "binary", rank{r}.hzs[.gz]: the same events in the
    binary format, sanitizer/trace/binary/) and expected.json into `out`; returns a summary dict.
    `mix`: "decode" (the decode layer model) or a --mix value (parse_mix; ValueError if bad)."""
    mixed = None if mix == "decode" else parse_mix(mix)
    if mixed is None:
        hazards = plan_hazards(inject, seed, events)
    else:
        if inject and not (mixed["coll"] and mixed["scope"] and min(mixed["record"], mixed["wait"]) >= 2
                           and mixed["fence"] == "coll"):
            raise ValueError("--inject with --mix needs a fenced collective in a scope per unit "
                             "(coll >= 1, scope >= 2, record and wait >= 2)")
        unit = mix_unit_size(mixed)
        per_step = max(1, MIX_STEP_EVENTS // unit)
        hazards = plan_hazards(inject, seed, events, per_step * unit + 2, per_step)
    out.mkdir(parents=True, exist_ok=True)
    suffix = (".hzs" if fmt == "binary" else ".jsonl") + (".gz" if gzip_level else "")
    for pattern in ("rank*.jsonl", "rank*.jsonl.gz", "rank*.hzs", "rank*.hzs.gz"):
        for stale in out.glob(pattern):
            stale.unlink()
    expected: list[dict] = []
    files = []
    start = time.perf_counter()
    for rank in range(ranks):
        path = out / f"rank{rank}{suffix}"
        header = {"hazsan": 1, "rank": rank, "world_size": ranks, "device": f"cuda:{rank}",
                  "generator": f"benchmarks/gen_decode_trace.py v{GENERATOR_VERSION}", "seed": seed}
        writer = TraceWriter(path, header, events, gzip_level, lean, fmt)
        model = (DecodeRank(rank, writer, seed, hazards, stacks) if mixed is None
                 else MixRank(rank, writer, seed, hazards, stacks, mixed))
        model.run()
        written = writer.close()
        last_line = written + 1
        expected += [e for e in model.expected if e["line"] <= last_line]
        files.append({"file": path.name, "events": written, "bytes": path.stat().st_size})
    seconds = time.perf_counter() - start
    summary = {"generator_version": GENERATOR_VERSION, "events_per_rank": events, "ranks": ranks,
               "seed": seed, "inject": inject, "gzip": gzip_level, "stacks": stacks, "lean": lean, "format": fmt,
               "mix": mix, **({"mix_spec": MIXES.get(mix, mix)} if mixed else {}),
               "files": files,
               "seconds": round(seconds, 3)}
    (out / "expected.json").write_bytes(orjson.dumps({"findings": expected}, option=orjson.OPT_INDENT_2))
    (out / "meta.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=5_000_000, help="events per rank file (default 5,000,000)")
    ap.add_argument("--ranks", type=int, default=1, help="rank files to write (default 1)")
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--inject", type=int, default=0, metavar="N",
                    help="plant N hazards; OUT/expected.json lists the findings they must produce")
    ap.add_argument("--gzip", nargs="?", type=int, const=1, default=None, metavar="LEVEL",
                    help="write .jsonl.gz (compression level, default 1)")
    ap.add_argument("--stacks", action="store_true", help="give every alloc a 3-frame stack (longer lines)")
    ap.add_argument("--lean", action="store_true",
                    help="leave out the optional fields (t, site, op, shape, dtype, requested): shorter lines")
    ap.add_argument("--format", choices=("jsonl", "binary"), default="jsonl",
                    help="jsonl: rank{r}.jsonl (default); binary: rank{r}.hzs, the same events in frames of "
                         "msgpack arrays (what capture writes; docs/trace-format.md)")
    ap.add_argument("--mix", default="decode", metavar="SPEC",
                    help="the program: decode (default, the layer model), a named mix (" + ", ".join(MIXES)
                         + ") or counts per unit, e.g. alloc=10,free=10,scope=4,launch=4,record=4,wait=4,coll=2,"
                           "record_stream=1,free_done=1,sites=3,streams=2,events=4 (see MixRank)")
    args = ap.parse_args(argv)
    if args.events < 1 or args.ranks < 1:
        ap.error("--events and --ranks must be positive")
    try:
        s = generate(args.out, events=args.events, ranks=args.ranks, seed=args.seed, inject=args.inject,
                     gzip_level=args.gzip, stacks=args.stacks, lean=args.lean, fmt=args.format, mix=args.mix)
    except ValueError as exc:
        ap.error(str(exc))
    total = sum(f["events"] for f in s["files"])
    size = sum(f["bytes"] for f in s["files"])
    print(f"wrote {total:,} events in {len(s['files'])} file(s), {size / MiB:,.1f} MiB, to {args.out} "
          f"in {s['seconds']:.1f} s ({total / s['seconds']:,.0f} events/s)")
    if args.inject:
        print(f"planted {args.inject} hazard(s); expected findings in {args.out / 'expected.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
