"""Shared-memory windows: one file in /dev/shm per rank, mapped by every rank process.

A window is what NCCL's symmetric memory gives each rank: a range of memory that every peer can
load from and store to directly. Here it is a file in a tmpfs (/dev/shm by default) mapped with
mmap by all ranks, so a peer's comm thread reading `window[offset:offset+n]` sees exactly the bytes
the owner's tensors hold at that moment, torn writes included.

Tensors are exposed with torch.frombuffer(mmap, count, offset): each call makes its own storage
(so a block's storage dies, and its finalizer runs, independently of every other block's) whose
memory *is* the shared mapping. torch is imported lazily.
"""
from __future__ import annotations

import mmap
import os
import uuid
from dataclasses import dataclass

DEFAULT_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


@dataclass(frozen=True)
class WindowFiles:
    """Where one world's shared state lives; picklable, handed to every rank process."""

    directory: str
    job: str
    world_size: int
    window_bytes: int

    @classmethod
    def create(cls, world_size: int, window_bytes: int, directory: str | None = None) -> "WindowFiles":
        """Create the files (zero-filled windows and control block). Call once, before the ranks start."""
        if world_size < 1:
            raise ValueError("world_size must be at least 1")
        if window_bytes <= 0 or window_bytes % mmap.PAGESIZE:
            raise ValueError(f"window_bytes must be a positive multiple of {mmap.PAGESIZE}")
        directory = directory or DEFAULT_DIR
        if directory is None:
            import tempfile
            directory = tempfile.gettempdir()
        spec = cls(directory, f"hazsan-{os.getpid()}-{uuid.uuid4().hex[:8]}", world_size, window_bytes)
        for r in range(world_size):
            _make_file(spec.window_path(r), window_bytes)
        _make_file(spec.control_path(), CONTROL_BYTES_PER_RANK * (world_size + 1))
        return spec

    def window_path(self, rank: int) -> str:
        return os.path.join(self.directory, f"{self.job}.win{rank}")

    def control_path(self) -> str:
        return os.path.join(self.directory, f"{self.job}.ctl")

    def paths(self) -> list[str]:
        return [self.window_path(r) for r in range(self.world_size)] + [self.control_path()]

    def unlink(self) -> None:
        """Remove the files (mappings stay valid in processes that still hold them)."""
        for p in self.paths():
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


CONTROL_BYTES_PER_RANK = 64   # one cache line per rank: no false sharing between ranks' counters


def _make_file(path: str, size: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


class Mapping:
    """One shared file mapped into this process."""

    def __init__(self, path: str, size: int):
        self.path = path
        self.size = size
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < size:
                raise ValueError(f"{path}: shared file is {os.fstat(fd).st_size} bytes, expected {size}")
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        import torch
        # One uint8 tensor over the whole mapping: its data_ptr is the window's base address in
        # this process (peers map the same file elsewhere; offsets are what they share).
        self.whole = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.base = self.whole.data_ptr()

    def bytes_at(self, offset: int, nbytes: int):
        """A fresh uint8 tensor (its own storage) over [offset, offset+nbytes) of the mapping."""
        import torch
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"range [{offset}, {offset + nbytes}) outside the {self.size}-byte window {self.path}")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=offset)

    def view(self, offset: int, nbytes: int, dtype, shape=None):
        """Typed view of [offset, offset+nbytes) sharing the whole mapping's storage (no new storage)."""
        t = self.whole[offset:offset + nbytes].view(dtype)
        return t if shape is None else t.view(shape)

    def close(self) -> None:
        self.whole = None
        try:
            self.mm.close()
        except BufferError:
            pass   # tensors still map it; the mapping goes away with the process
