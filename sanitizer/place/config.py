"""PYTORCH_CUDA_ALLOC_CONF, as far as it changes where the caching allocator places blocks.

Source read: c10/core/AllocatorConfig.{h,cpp} (AcceleratorAllocatorConfig, PyTorch main as of
late 2025, commit 065861fb for the .cpp) and c10/cuda/CUDAAllocatorConfig.{h,cpp} of 2.4-2.8, which
parse the same keys with the same tokenizer (',', ':', '[', ']' are tokens, blanks are dropped).

Keys are sorted into three kinds:

- modelled: they change placement and the model implements them
  (max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions, large_segment_size_mb);
- inert: accepted, they do not change placement in what the model covers
  (host/pinned-allocator keys, release_lock_on_cudamalloc, ``expandable_segments:False``, ...);
- refused: they change placement in a way the model does not implement
  (``expandable_segments:True``, ``backend:cudaMallocAsync``, ...): parse raises ConfigError
  naming the key, so a user never gets a placement that silently ignores their setting.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

KB = 1024
MB = 1024 * 1024

# c10/core/AllocatorConfig.h (earlier: top of CUDACachingAllocator.cpp), unchanged 2.4 .. 2.14.
K_MIN_BLOCK_SIZE = 512            # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MB             # largest "small" allocation
K_SMALL_BUFFER = 2 * MB           # small allocations are packed in 2 MiB segments
K_LARGE_BUFFER = 20 * MB          # default large segment ("large_segment_size_mb")
K_MIN_LARGE_ALLOC = 10 * MB       # requests below this may share a large segment
K_ROUND_LARGE = 2 * MB            # larger requests get their own segment, rounded to 2 MiB

# roundup_power2_divisions: one entry per power-of-two interval from 1 MiB to 64 GiB.
K_ROUNDUP_INTERVALS = 16
K_ROUNDUP_START_LOG2 = 20         # log2(1 MiB)

UNLIMITED = (1 << 64) - 1         # std::numeric_limits<size_t>::max()


class ConfigError(ValueError):
    """An allocator setting the model cannot honour, or one PyTorch itself would reject."""


_INERT_BOOL_KEYS = {
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_use_background_threads",
}
_INERT_VALUE_KEYS = {
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_max_register_threads",
}


@dataclass(frozen=True)
class AllocatorConfig:
    """The placement-relevant allocator settings; defaults are PyTorch's."""

    max_split_size: int = UNLIMITED
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    large_segment_size: int = K_LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * K_ROUNDUP_INTERVALS
    garbage_collection_threshold: float = 0.0
    source: str = ""
    notes: tuple[str, ...] = field(default=(), compare=False)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str | None) -> "AllocatorConfig":
        """Parse a PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF value (None or "" = defaults)."""
        if not text or not text.strip():
            return cls()
        return _Parser(text).parse()

    @classmethod
    def from_env(cls, environ: "os._Environ[str] | dict[str, str] | None" = None) -> "AllocatorConfig":
        """PYTORCH_ALLOC_CONF wins over the older PYTORCH_CUDA_ALLOC_CONF, as in PyTorch >= 2.8."""
        env = os.environ if environ is None else environ
        return cls.parse(env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF"))

    # ---- the rules that use the settings ----------------------------------------------
    def divisions_for(self, size: int) -> int:
        """AcceleratorAllocatorConfig::roundup_power2_divisions(size)."""
        index = (size.bit_length() - 1) - K_ROUNDUP_START_LOG2
        index = max(0, min(index, K_ROUNDUP_INTERVALS - 1))
        return self.roundup_power2_divisions[index]

    def describe(self) -> str:
        parts = []
        if self.max_split_size != UNLIMITED:
            parts.append(f"max_split_size_mb:{self.max_split_size // MB}")
        if self.max_non_split_rounding_size != K_LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_size // MB}")
        if self.large_segment_size != K_LARGE_BUFFER:
            parts.append(f"large_segment_size_mb:{self.large_segment_size // MB}")
        divs = self.roundup_power2_divisions
        if len(set(divs)) == 1 and divs[0]:
            parts.append(f"roundup_power2_divisions:{divs[0]}")
        elif any(divs):
            parts.append("roundup_power2_divisions:[" + ",".join(
                f"{1 << i}:{d}" for i, d in enumerate(divs)) + "]")
        return ",".join(parts) or "defaults"


class _Parser:
    """Mirrors AcceleratorAllocatorConfig::parseArgs; error messages name the offending key."""

    def __init__(self, text: str):
        self.text = text
        self.tokens: list[str] = []
        buf = ""
        for ch in text:
            if ch in ",:[]":
                if buf:
                    self.tokens.append(buf)
                    buf = ""
                self.tokens.append(ch)
            elif not ch.isspace():
                buf += ch
        if buf:
            self.tokens.append(buf)
        self.values: dict = {}
        self.notes: list[str] = []

    def _err(self, msg: str) -> ConfigError:
        return ConfigError(f"PYTORCH_CUDA_ALLOC_CONF={self.text!r}: {msg}")

    def _expect(self, i: int, tok: str) -> None:
        if i >= len(self.tokens) or self.tokens[i] != tok:
            raise self._err(f"expected {tok!r} at token {i}")

    def _value(self, i: int, key: str) -> str:
        if i >= len(self.tokens) or self.tokens[i] in ",:[]":
            raise self._err(f"expecting a value for {key}")
        return self.tokens[i]

    def _int(self, i: int, key: str) -> int:
        v = self._value(i, key)
        try:
            return int(v)
        except ValueError:
            raise self._err(f"{key} expects an integer, got {v!r}") from None

    def _bool(self, i: int, key: str) -> bool:
        v = self._value(i, key)
        if v not in ("True", "False"):
            raise self._err(f"expected a single True/False argument for {key}, got {v!r}")
        return v == "True"

    def parse(self) -> AllocatorConfig:
        t = self.tokens
        i = 0
        while i < len(t):
            key = t[i]
            self._expect(i + 1, ":")
            i = self._key(key, i + 2)
            if i + 1 < len(t):
                self._expect(i + 1, ",")
                i += 2
            else:
                i += 1
        return AllocatorConfig(source=self.text, notes=tuple(self.notes), **self.values)

    def _key(self, key: str, i: int) -> int:
        """Consume the value of `key` starting at token i; return the index of its last token."""
        if key == "max_split_size_mb":
            v = self._int(i, key)
            if v < K_LARGE_BUFFER // MB:
                raise self._err(f"max_split_size_mb too small, must be >= {K_LARGE_BUFFER // MB}")
            self.values["max_split_size"] = min(v, UNLIMITED // MB) * MB
            return i
        if key == "max_non_split_rounding_mb":
            v = self._int(i, key)
            if v < K_LARGE_BUFFER // MB:
                raise self._err(f"max_non_split_rounding_mb too small, must be >= {K_LARGE_BUFFER // MB}")
            self.values["max_non_split_rounding_size"] = v * MB
            return i
        if key == "large_segment_size_mb":
            v = self._int(i, key)
            if v <= K_MIN_LARGE_ALLOC // MB:
                raise self._err(f"large_segment_size_mb must be > {K_MIN_LARGE_ALLOC // MB}")
            self.values["large_segment_size"] = v * MB
            return i
        if key == "roundup_power2_divisions":
            return self._roundup(i)
        if key == "garbage_collection_threshold":
            v = float(self._value(i, key))
            if not 0.0 < v < 1.0:
                raise self._err("garbage_collection_threshold must be in (0.0, 1.0)")
            self.values["garbage_collection_threshold"] = v
            self.notes.append("garbage_collection_threshold only acts under a memory-fraction cap; "
                              "the model has no device capacity, so it changes nothing here")
            return i
        if key == "expandable_segments":
            if self._bool(i, key):
                raise self._err(
                    "expandable_segments:True is not modelled: segments then grow by mapping pages "
                    "into one reserved range per stream, so block addresses follow a different rule. "
                    "Replay with expandable_segments:False, or do not use `hazsan place` for this run")
            return i
        if key == "backend":
            v = self._value(i, key)
            if v == "native":
                return i
            if v in ("cudaMallocAsync", "hipMallocAsync"):
                raise self._err(
                    f"backend:{v} is not modelled: the driver's stream-ordered pool decides placement, "
                    "not the caching allocator; `hazsan place` only models backend:native")
            raise self._err(f"unknown allocator backend {v!r} (options: native, cudaMallocAsync)")
        if key == "graph_capture_record_stream_reuse":
            if self._bool(i, key):
                raise self._err(
                    "graph_capture_record_stream_reuse:True is not modelled: blocks freed during "
                    "capture are then reused by graph topology, which a trace does not record")
            return i
        if key == "per_process_memory_fraction":
            v = float(self._value(i, key))
            if v < 1.0:
                raise self._err(
                    "per_process_memory_fraction < 1 is not modelled: it makes the allocator release "
                    "cached segments under pressure, and the model has no device capacity")
            return i
        if key in _INERT_BOOL_KEYS:
            self._bool(i, key)
            return i
        if key in _INERT_VALUE_KEYS:
            self._value(i, key)
            return i
        raise self._err(f"unrecognized CachingAllocator option {key!r}")

    def _roundup(self, i: int) -> int:
        key = "roundup_power2_divisions"
        divs = [0] * K_ROUNDUP_INTERVALS
        t = self.tokens
        if i < len(t) and t[i] == "[":
            first = True
            last_index = 0
            i += 1
            while i < len(t) and t[i] != "]":
                interval = t[i]
                self._expect(i + 1, ":")
                d = self._int(i + 2, key)
                if d != 0 and d & (d - 1):
                    raise self._err("for roundups, the divisions have to be a power of 2 or 0")
                if interval == ">":
                    for k in range(last_index, K_ROUNDUP_INTERVALS):
                        divs[k] = d
                else:
                    try:
                        mb = int(interval)
                    except ValueError:
                        raise self._err(f"bad roundup_power2_divisions interval {interval!r}") from None
                    if mb <= 0 or mb & (mb - 1):
                        raise self._err("for roundups, the intervals have to be a power of 2 (in MB)")
                    index = min(mb.bit_length() - 1, K_ROUNDUP_INTERVALS - 1)
                    if first:
                        for k in range(0, index):
                            divs[k] = d
                        first = False
                    divs[index] = d
                    last_index = index
                i += 3
                if i < len(t) and t[i] == ",":
                    i += 1
            if i >= len(t):
                raise self._err("roundup_power2_divisions: missing ']'")
            self.values["roundup_power2_divisions"] = tuple(divs)
            return i
        d = self._int(i, key)
        if d <= 0 or d & (d - 1):
            raise self._err("for roundups, the divisions have to be a power of 2")
        self.values["roundup_power2_divisions"] = (d,) * K_ROUNDUP_INTERVALS
        return i
