"""Scan settings: which callables open a symmetric-memory scope, how deep to follow helpers, and
extra call kinds. Read from a TOML or JSON file and/or command-line options.

File layout (TOML shown; JSON is the same object). Keys may sit at the top level, under ``[scan]``,
or, in a pyproject.toml, under ``[tool.hazsan.scan]``::

    scopes = ["my_pkg.symm_scope"]      # added to the defaults
    replace_default_scopes = false      # true: only the scopes listed here
    depth = 3                           # helper-following depth
    guard_keywords = ["disabled"]       # keyword arguments reported as the scope's guard
    exclude = ["test/*"]                # globs on file paths relative to the PATH given
    [scan.calls]                        # extra call kinds (".name" = tensor method, globs allowed)
    alloc = ["my_pkg.alloc_out"]
    copy = []
    neutral = ["my_pkg.log"]
    compute = []
"""
from __future__ import annotations

import json
from sanitizer.scan import _toml as tomllib
from dataclasses import dataclass, field
from pathlib import Path

from sanitizer.scan.catalog import CallCatalog

# A name without dots matches any callee whose last component it is: `use_symmetric_memory`
# covers the plain call, `self.use_symmetric_memory(...)`, `pynccl_allocator.use_symmetric_memory`
# and `from x import use_symmetric_memory as usm`. Dotted names match the resolved qualified name.
DEFAULT_SCOPES = (
    "use_symmetric_memory",             # SGLang: returns SymmetricMemoryContext or nullcontext
    "SymmetricMemoryContext",           # SGLang: the context itself
    "sanitizer.symmetric_scope",        # hazsan's own (dotted: other projects' `symmetric_scope`
                                        # helpers are not hazsan's, and are found by what they enter)
    "torch.cuda.use_mem_pool",          # any MemPool, incl. torch.distributed._symmetric_memory.get_mem_pool
    "torch.cuda.memory.use_mem_pool",
)
# Scopes that are symmetric windows by their name alone (use_mem_pool's pool decides for it).
WINDOW_SCOPES = ("use_symmetric_memory", "SymmetricMemoryContext", "sanitizer.symmetric_scope")
# torch.distributed._symmetric_memory has no scope of its own: its pool is entered as
# `torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device))`, which the use_mem_pool entries catch
# (the scope's `pool` field then names get_mem_pool, and `symmetric` says so).
DEFAULT_DEPTH = 3
DEFAULT_GUARD_KEYWORDS = ("disabled",)


class ConfigError(Exception):
    """Unusable configuration; the message names the file (and line for TOML errors)."""


@dataclass
class ScanConfig:
    scopes: tuple[str, ...] = DEFAULT_SCOPES
    depth: int = DEFAULT_DEPTH
    guard_keywords: tuple[str, ...] = DEFAULT_GUARD_KEYWORDS
    exclude: tuple[str, ...] = ()
    catalog: CallCatalog = field(default_factory=CallCatalog)
    caller_depth: int = 3            # call-chain levels searched for the conditions on a scope

    @classmethod
    def build(cls, config_file: str | None = None, scopes=(), no_default_scopes: bool = False,
              depth: int | None = None, exclude=()) -> "ScanConfig":
        """Defaults, then the file, then command-line options (which add to or override the file)."""
        data = _load(config_file) if config_file else {}
        where = config_file or "options"
        replace = bool(_typed(data, "replace_default_scopes", bool, False, where)) or no_default_scopes
        names = [] if replace else list(DEFAULT_SCOPES)
        names += _strings(data, "scopes", where) + list(scopes)
        if not names:
            raise ConfigError(f"{where}: no scope callables left (give --scope NAME or drop "
                              "replace_default_scopes/--no-default-scopes)")
        file_depth = _typed(data, "depth", int, DEFAULT_DEPTH, where)
        depth = file_depth if depth is None else depth
        if depth < 0:
            raise ConfigError(f"{where}: depth must be >= 0, got {depth}")
        guards = _strings(data, "guard_keywords", where) or list(DEFAULT_GUARD_KEYWORDS)
        calls = data.get("calls", {})
        if not isinstance(calls, dict):
            raise ConfigError(f"{where}: 'calls' must be a table of lists")
        unknown = set(calls) - {"alloc", "copy", "neutral", "compute"}
        if unknown:
            raise ConfigError(f"{where}: unknown call kind(s) {sorted(unknown)} under 'calls' "
                              "(alloc, copy, neutral, compute)")
        catalog = CallCatalog().extended(**{k: _strings(calls, k, where) for k in calls})
        return cls(scopes=tuple(dict.fromkeys(names)), depth=depth, guard_keywords=tuple(guards),
                   exclude=tuple(_strings(data, "exclude", where)) + tuple(exclude), catalog=catalog)


def _load(path: str) -> dict:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        if p.suffix == ".json":
            data = json.loads(raw)
        else:
            data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected an object/table at the top")
    if isinstance(data.get("tool"), dict) and isinstance(data["tool"].get("hazsan"), dict):
        data = data["tool"]["hazsan"]
    if isinstance(data.get("scan"), dict):
        data = data["scan"]
    known = {"scopes", "replace_default_scopes", "depth", "guard_keywords", "exclude", "calls"}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)} (known: {sorted(known)})")
    return data


def _typed(data: dict, key: str, kind: type, default, where: str):
    value = data.get(key, default)
    if type(value) is not kind:
        raise ConfigError(f"{where}: '{key}' must be {kind.__name__}, got {value!r}")
    return value


def _strings(data: dict, key: str, where: str) -> list[str]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: '{key}' must be a list of non-empty strings")
    return list(value)
