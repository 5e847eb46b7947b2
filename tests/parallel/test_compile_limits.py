"""Compiling stages in many workers: inductor's compile threads per worker, the NCCL watchdog's
allowance for the first call's compile."""
import datetime
from unittest import mock

import pytest
import torch
import torch._inductor.config as inductor
import torch.distributed as dist
import torch.nn as nn

from pipetorch.parallel.worker import compiled

from pipetorch.parallel.comm import rendezvous
from pipetorch.parallel.worker.compiled import CompiledStage
from pipetorch.parallel.comm.payloads import DeviceStage


@pytest.mark.parametrize("workers, cores, threads", [(8, 16, 2), (3, 16, 5), (32, 16, 1),
                                                     (1, 4, 4)])
def test_each_worker_compiles_with_its_share_of_the_cores(workers, cores, threads):
    # every worker's inductor started min(32, cores) compile processes: 8 x 16 on 16 cores
    with inductor.patch(compile_threads=32):  # restored afterwards
        assert compiled.limit_compile_threads(workers=workers, cores=cores) == threads
        assert inductor.compile_threads == threads


def test_the_cap_never_raises_a_lower_setting():
    with inductor.patch(compile_threads=1):  # as TORCHINDUCTOR_COMPILE_THREADS=1
        assert compiled.limit_compile_threads(workers=2, cores=16) == 1


def test_the_watchdog_allows_for_compiling_on_nccl_only():
    allowance = compiled.COMPILE_ALLOWANCE
    assert compiled.watchdog_timeout(60, backend="nccl", compiling=True) == 60 + allowance
    assert compiled.watchdog_timeout(60, backend="nccl", compiling=False) == 60
    assert compiled.watchdog_timeout(60, backend="gloo", compiling=True) == 60


def test_compile_backend_names_the_backend_of_compiled_stages():
    plain = DeviceStage(nn.Linear(2, 2), route=None, inputs=())
    fast = DeviceStage(CompiledStage(nn.Linear(2, 2), "inductor"), route=None, inputs=())
    assert compiled.compile_backend([plain]) is None
    assert compiled.compile_backend([plain, fast]) == "inductor"


def test_join_gives_the_process_group_its_own_timeout():
    meeting = rendezvous.Rendezvous("127.0.0.1", 1, "p/", 2, 2, 1)
    with mock.patch.object(dist, "TCPStore") as store, \
            mock.patch.object(dist, "PrefixStore"), \
            mock.patch.object(dist, "init_process_group") as init:
        rendezvous.join(meeting, rank=0, backend="nccl", timeout=60, group_timeout=90)
        rendezvous.join(meeting, rank=0, backend="gloo", timeout=60)
    assert store.call_args.kwargs["timeout"] == datetime.timedelta(seconds=60)
    assert [c.kwargs["timeout"] for c in init.call_args_list] == [
        datetime.timedelta(seconds=90), datetime.timedelta(seconds=60)]
