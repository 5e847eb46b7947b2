"""Shared memory between the processes of one machine: activations, a call's inputs and
outputs, the DataLoader's ring and the weights' file (weights/shared.py) are all memory files.

Each is an anonymous memory file (memfd) that its maker keeps open; another process of the
same user opens it through /proc/<maker pid>/fd/<fd>, and a pipe's end likewise. Nothing has a
name in /dev/shm, so nothing is left behind however a process ends, and /dev/shm's size limit
does not apply.

    maker:   make(size) -> Address(pid, fd, size), bytes     (the Address crosses in a message)
    other:   attach(address) -> the same bytes                 (valid while the maker keeps fd)
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import torch

__all__: list[str] = []

ALIGN = 64  # bytes: every tensor laid out in a file starts on a cache line


@dataclass(frozen=True)
class Address:
    """A memory file as another process reaches it."""

    pid: int
    fd: int
    size: int


def reachable() -> bool:
    """Whether this machine lets processes share memory files (Linux's memfd and /proc)."""
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


def aligned(nbytes: int, to: int = ALIGN) -> int:
    return (nbytes + to - 1) // to * to


def make(size: int) -> tuple[Address, torch.Tensor]:
    """A new memory file of `size` bytes (zeros) and its bytes; the caller closes `Address.fd`
    once no other process needs to attach any more."""
    if not reachable():
        raise OSError("pipetorch's shared memory needs Linux (memfd_create and /proc): run "
                      "the workers and the asynchronous DataLoader on Linux")
    fd = new_file(size)
    try:
        return Address(os.getpid(), fd, size), _map(fd, size)
    except BaseException:
        os.close(fd)
        raise


def new_file(size: int, *, name: str = "pipetorch", reserve: bool = False) -> int:
    """The descriptor of a new memory file of `size` bytes (zeros); with `reserve`, every page
    is allocated now, so that running out of memory is an OSError here rather than a SIGBUS
    at a later write. Raises OSError."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        if reserve:
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
        return fd
    except BaseException:
        os.close(fd)
        raise


def attach(address: Address) -> torch.Tensor:
    """The bytes of another process's memory file (they stay mapped while a tensor views them)."""
    fd = reopen(address.pid, address.fd, os.O_RDWR)
    try:
        return _map(fd, address.size)
    finally:
        os.close(fd)


def reopen(pid: int, fd: int, flags: int) -> int:
    """A descriptor of our own for what process `pid` holds open as `fd` (a memory file, a pipe's
    end: a pipe opened for writing gets the writing end)."""
    return os.open(f"/proc/{pid}/fd/{fd}", flags | os.O_CLOEXEC)


def _map(fd: int, size: int) -> torch.Tensor:
    return torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
