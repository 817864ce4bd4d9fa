"""TOML reading: the standard library's tomllib (Python 3.11+), else the tomli backport if present.

On Python 3.10 without tomli, TOML files give a clear error and JSON files still work.
"""
from __future__ import annotations

try:
    import tomllib as _toml
except ModuleNotFoundError:  # Python 3.10
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ModuleNotFoundError:
        _toml = None

if _toml is not None:
    TOMLDecodeError = _toml.TOMLDecodeError
else:
    class TOMLDecodeError(ValueError):
        pass


def loads(text: str) -> dict:
    if _toml is None:
        raise TOMLDecodeError("reading TOML needs Python 3.11+ or the 'tomli' package; "
                              "give the same settings as a .json file instead")
    return _toml.loads(text)
