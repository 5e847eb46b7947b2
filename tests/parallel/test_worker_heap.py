"""A stage worker keeps its freed heap for the next micro-batch (comm/resident.reuse_freed):
with glibc's defaults, every gradient and activation of a few MB is fresh pages the kernel
faults in and zeroes, a quarter of a worker's CPU at width 2048."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

import pipetorch as poptorch
from pipetorch.parallel.layout import placement
from test_memory_ratios import Stack  # 4 Linear layers, the third beginning ipu 1

WIDTH = 1024  # a gradient of 4 MB: over glibc's first mmap threshold, as a real model's are
PAGES = WIDTH * WIDTH * 4 // 4096  # the pages of one weight's gradient


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


def test_a_stage_workers_warm_calls_fault_in_less_than_a_gradient():
    torch.manual_seed(0)
    model = Stack(WIDTH)
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    before = {r["pid"] for r in placement.live_workers()}
    wrapper = poptorch.trainingModel(model, opts, optimizer)
    x, target = torch.randn(16, WIDTH), torch.randn(16, WIDTH)
    try:
        for _ in range(3):  # the first calls allocate what every later one reuses
            wrapper(x, target)
        workers = [r["pid"] for r in placement.live_workers() if r["host_pid"] == os.getpid()
                   and r["pid"] not in before]  # this wrapper's, not an earlier test's
        assert len(workers) == 2
        faults = [minor_faults(pid) for pid in workers]
        calls = 3
        for _ in range(calls):
            wrapper(x, target)
        per_call = [(minor_faults(pid) - b) / calls for pid, b in zip(workers, faults, strict=True)]
    finally:
        wrapper.destroy()
    # glibc's defaults: each of 4 micro-batches' gradients (2 weights a stage) faulted in again
    assert max(per_call) < PAGES, f"page faults a call per worker: {per_call}"


_ALLOCATE = textwrap.dedent("""
    import ctypes, sys
    from pipetorch.parallel.comm import resident
    resident.reuse_freed()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    def faults():
        with open("/proc/self/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[7])
    size = 16 << 20
    for _ in range(2):
        block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(ctypes.c_void_p(block))
    before = faults()
    for _ in range(10):
        block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(ctypes.c_void_p(block))
    print((faults() - before) // 10)
""")


def faults_per_block(env: dict[str, str]) -> int:
    done = subprocess.run([sys.executable, "-c", _ALLOCATE], env=os.environ | env, text=True,
                          capture_output=True, timeout=120, check=True)
    return int(done.stdout.split()[-1])


def test_freed_blocks_are_reused_unless_the_user_set_glibcs_thresholds():
    pages = (16 << 20) // 4096
    assert faults_per_block({}) < pages // 10  # kept: the second block is the first's pages
    # the user's own setting wins: a fixed threshold maps, and unmaps, every such block
    assert faults_per_block({"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}) >= pages
