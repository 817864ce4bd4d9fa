"""Stand-in for sgl_kernel on CPU (test set-up of `make test-sglang`, see ../sitecustomize.py).

SGLang 0.5.23 with SGLANG_USE_CPU_ENGINE=1 imports its CPU helpers from sgl_kernel as its modules
load; plain decoding on the torch_native backend calls none of them. The ops NGRAM speculative
decoding calls are written here in torch (ops.py); any other op imports, and raises naming itself
when called.
"""
from sgl_kernel import ops as _ops
from sgl_kernel.missing import missing

__version__ = "0.0.0+cpu-standin"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    op = getattr(_ops, name, None)
    return op if op is not None else missing(f"sgl_kernel.{name}")
