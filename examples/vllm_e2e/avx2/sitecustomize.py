"""run.py's gloo configuration: vLLM loads its AVX2 kernel library (`vllm._C_AVX2`), as on a CPU
without AVX-512. That build registers no shared-memory ops (`_C::init_shm_manager`, `shm_*`), so
vLLM's CpuCommunicator takes torch.distributed (gloo) for the TP collectives. Only on this folder's
PYTHONPATH, and only with VLLM_E2E_KERNELS=avx2 (which every vLLM process inherits)."""
import os

if os.environ.get("VLLM_E2E_KERNELS") == "avx2":
    import wrapt

    def _load_avx2(cls=None):
        try:
            import vllm._C_AVX2  # noqa: F401  (the library is named _C_AVX2, its module _C)
        except ImportError as exc:
            if "dynamic module does not define module export function" not in str(exc):
                raise

    def _patch(module):
        module.CpuPlatform.import_kernels = classmethod(_load_avx2)

    wrapt.register_post_import_hook(_patch, "vllm.platforms.cpu")
