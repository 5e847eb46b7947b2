"""Generation's hops between two processes, over gloo and over shared memory: values of every
size arrive whole and equal."""
from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipetorch.parallel.comm import hops as hop_module
from pipetorch.parallel.comm.hops import FIRST, Hops
from pipetorch.parallel.comm.shm import new_link

_TIMEOUT = 60  # seconds for both processes together


def _values() -> list[object]:
    """One value of each way a hop sends: whole in the first message; with tensors too large
    for it; with a header too large for it (its Python data)."""
    return [{"hidden": torch.arange(24.).reshape(2, 3, 4), "step": 3},
            (torch.randn(8, FIRST // 16, generator=torch.Generator().manual_seed(0)),
             torch.arange(5)),
            ["x" * (2 * FIRST), torch.ones(3, dtype=torch.int64)]]


def _run(rank: int, store: str, kind: str, failures: multiprocessing.Queue) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=2)
        cpu = torch.device("cpu")
        link = new_link(kind, store=dist.FileStore(f"{store}-links", 2), name="hops-",
                        rank=rank, device=cpu, wire_device=cpu, timeout=_TIMEOUT)
        link.open(hop_module.channels((0, 1), rank))
        hops = Hops(link)
        for value in _values():
            if rank == 0:
                hops.send(value, 1)
            else:
                got = hops.receive(0, torch.device("cpu"))
                torch.utils._pytree.tree_map(
                    lambda want, have: torch.testing.assert_close(have, want)
                    if isinstance(want, torch.Tensor) else None, value, got)
                assert repr(got) == repr(value)
        hops.wait()
        link.close()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        failures.put(f"rank {rank}: {traceback.format_exc()}")


@pytest.mark.parametrize("kind", ["gloo", "shm"])
def test_values_of_every_size_cross_whole(tmp_path: Path, kind: str) -> None:
    context = multiprocessing.get_context("spawn")
    failures = context.Queue()
    processes = [context.Process(target=_run, args=(rank, str(tmp_path / "store"), kind,
                                                    failures))
                 for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(_TIMEOUT)
    for process in processes:
        if process.is_alive():
            process.kill()
    assert failures.empty(), failures.get(timeout=5)
    assert [p.exitcode for p in processes] == [0, 0]


def test_channels_run_between_consecutive_stages_on_different_devices() -> None:
    channels = hop_module.channels((0, 1, 1, 0), 1)
    assert [(c.peer, c.outgoing) for c in channels] == [(0, False), (0, True)]
    assert hop_module.channels((0, 0), 0) == []
