"""Symmetric memory on CPU: reproduce, measure and detect the symmetric-window fault class without a GPU.

NCCL symmetric kernels address peers' windows by offset and hold no tensor references; that is why
freeing a buffer early, or letting a transient land in the window, corrupts data. This package
builds the same on CPU, for real (not a model), so users can test their own allocation discipline:

  * each rank's window is a file in /dev/shm mapped by every rank process (shm.py); peers load and
    store into it directly;
  * blocks in the window are placed by hazsan's caching-allocator model (sanitizer.place), a pool
    whose segments are carved from the window, so window offsets mean what they would on a GPU;
    tensors allocated inside `comm.scope()` live *in* the window at the placed offset, and their
    blocks are released when their storage dies (comm.py);
  * one-sided all_reduce / all_gather run asynchronously on a comm thread per rank, addressed by
    (offset, size), with barriers in shared memory (sync.py) and a Work handle (wait, is_completed);
  * everything is recorded as schema-1 events: into hazsan capture's trace when HAZSAN=1, else into
    `trace_dir/rank<R>.jsonl` when trace_dir is given (record.py).

Knobs of SymmetricCommunicator: `end_barrier` (default True: a rank completes only when every
peer is done with its window, NCCL's documented contract; False: a barrier-less kernel, peers may
still load my input after my completion), `read_delay` (seconds a rank's comm thread waits before
loading: the time a collective is in flight, or one slow peer), `timeout` (a missing or failed
peer raises PeerFailure instead of hanging). `comm.record_stream(t)` holds t's block until the comm
work queued so far is done, as the CUDA caching allocator does.

    from sanitizer.testbed import SymmetricCommunicator, spawn

    def worker(rank, files):
        with SymmetricCommunicator(files, rank, trace_dir="traces") as comm:
            with comm.scope():
                x = torch.full((1024,), float(rank + 1))
            comm.all_reduce(x).wait()
            return x.sum().item()

    spawn(worker, world_size=2)
"""
from .comm import HOST_STREAM, SymmetricCommunicator, TestbedError, Work, WindowPool
from .launch import RankFailed, spawn
from .shm import WindowFiles
from .sync import PeerFailure

__all__ = ["HOST_STREAM", "PeerFailure", "RankFailed", "SymmetricCommunicator", "TestbedError",
           "WindowFiles", "WindowPool", "Work", "spawn"]
