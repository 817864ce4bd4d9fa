"""The CuPy GPU testbed without a GPU: it imports, says clearly what is missing, and its kernels
are the ones the communicator launches. (Its GPU self-check is `python -m
examples.mhc_decode.gpu_check`; it needs a CUDA device and CuPy.)"""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from sanitizer.testbed import SymmetricCommunicator, TestbedError, WindowFiles  # noqa: E402
from sanitizer.testbed import cuda  # noqa: E402


def _gpu():
    import torch
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_gpu(), reason="a GPU is here: the self-check covers it")
def test_without_a_gpu_the_constructor_names_what_is_missing(tmp_path):
    files = WindowFiles.create(1, 1 << 16, directory=str(tmp_path))
    try:
        with pytest.raises(TestbedError, match="CuPy|CUDA"):
            cuda.CudaSymmetricCommunicator(files, 0)
    finally:
        files.unlink()


def test_same_interface_as_the_cpu_testbed():
    assert issubclass(cuda.CudaSymmetricCommunicator, SymmetricCommunicator)
    for name in ("scope", "empty", "all_reduce", "all_gather", "all_reduce_at", "all_gather_at",
                 "record_stream", "synchronize", "close", "step", "offset"):
        assert callable(getattr(cuda.CudaSymmetricCommunicator, name))
    assert issubclass(cuda.CudaWork, cuda.Work)


def test_kernels_are_the_launched_ones():
    for name in ("hazsan_all_reduce", "hazsan_copy"):
        assert f'extern "C" __global__ void {name}(' in cuda.KERNELS


def test_stream_names_follow_capture():
    assert cuda.stream_name(0, 0) == "cuda:0"
    assert cuda.stream_name(1, 0x10) == "cuda:1:0x10"


@pytest.mark.skipif(_gpu(), reason="a GPU is here")
def test_gpu_check_exits_2_without_a_gpu(capsys):
    from examples.mhc_decode.gpu_check import main
    assert main(["--out", "unused"]) == 2
    assert "gpu_check:" in capsys.readouterr().err
