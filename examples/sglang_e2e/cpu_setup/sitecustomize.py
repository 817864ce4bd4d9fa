"""Test set-up for `make test-sglang`, NOT part of hazsan: what a stock CPU install of SGLang 0.5.23
lacks on this machine, supplied at interpreter start (run.py puts this folder on PYTHONPATH of the
SGLang processes only, bare and captured alike). Each piece is named for what it stands in for:

  * sgl_kernel/ (a package here): SGLang's `*_cpu` ops that NGRAM speculative decoding calls, in
    torch; the index has CUDA wheels of sgl-kernel only.
  * torchvision: only a CUDA build is installable; its import dies on `torchvision::nms`, whose
    fake implementation it registers unconditionally. The two schemas it registers that way (nms,
    qnms) are defined here when torch is imported; SGLang's text path never calls them.
  * torch_native_verify.py: the TARGET_VERIFY forward (speculative verification) that SGLang's
    torch_native attention backend lacks, patched in when that module is imported.
  * seed_early_read.py, only under SGLANG_E2E_SEED=early-read: the seeded hazard run.py checks
    hazsan flags.
"""
import os

import wrapt


def _torchvision_schemas(torch):
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                   "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"):
        name = schema.split("(")[0]
        if not torch._C._dispatch_has_kernel(f"torchvision::{name}") and \
                torch._C._jit_get_operation(f"torchvision::{name}")[0] is None:
            lib.define(schema)
    _torchvision_schemas.lib = lib       # a Library undefines its ops when collected


def _torch_native(module):
    from torch_native_verify import install
    install(module)


wrapt.register_post_import_hook(_torchvision_schemas, "torch")
wrapt.register_post_import_hook(_torch_native, "sglang.srt.layers.attention.torch_native_backend")


def _seed(module):
    from seed_early_read import install
    install(module)


if os.environ.get("SGLANG_E2E_SEED") == "early-read":
    wrapt.register_post_import_hook(_seed, "sglang.srt.distributed.parallel_state")
