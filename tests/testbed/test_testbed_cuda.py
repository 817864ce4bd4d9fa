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


def test_stream_names_follow_capture(monkeypatch):
    """The testbed names streams as capture's table does (capture/streams.py: `cuda:<d>` for the
    default stream, `cuda:<d>:s<n>` for others), through that very table when capture runs."""
    from sanitizer.capture.streams import StreamIds
    monkeypatch.setattr(cuda, "_STREAM_IDS", None)        # this process's table, from nothing
    table = StreamIds()
    assert cuda.stream_name(0, 0) == table.of_handle(0, 0) == "cuda:0"
    assert cuda.stream_name(1, 0x10) == table.of_handle(0x10, 1) == "cuda:1:s1"
    assert cuda.stream_name(1, 0x10) == "cuda:1:s1" and cuda.stream_name(1, 0x20) == "cuda:1:s2"


def test_stream_names_are_captures_own_under_capture(tmp_path):
    import os
    import subprocess
    import sys
    code = ("import torch, json\n"
            "from sanitizer.capture import runtime\n"
            "from sanitizer.testbed.cuda import stream_name\n"
            "cap = runtime.active()\n"
            "first = cap.streams.of_handle(0xAB, 0)\n"
            "print(json.dumps([first, stream_name(0, 0xAB), stream_name(0, 0xCD), cap.streams.of_handle(0xCD, 0)]))\n")
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(tmp_path / "t"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json
    assert json.loads(out.stdout.splitlines()[-1]) == ["cuda:0:s1", "cuda:0:s1", "cuda:0:s2", "cuda:0:s2"]


@pytest.mark.skipif(_gpu(), reason="a GPU is here")
def test_gpu_check_exits_2_without_a_gpu(capsys):
    from examples.mhc_decode.gpu_check import main
    assert main(["--out", "unused"]) == 2
    assert "gpu_check:" in capsys.readouterr().err
