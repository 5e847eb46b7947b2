"""Two torchrun nodes on 127.0.0.1: replicas span the nodes and train like one process."""
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import torchrun_job as job
from helpers.reference import plain_train_call
from helpers.torchrun import two_nodes

pytestmark = pytest.mark.slow

JOB = Path(job.__file__)


def test_two_nodes_train_like_two_replicas_in_one_process(tmp_path):
    results = two_nodes(JOB, tmp_path)
    assert [(r["process"], r["processes"], r["workers"]) for r in results] == [(0, 2, 1), (1, 2, 1)]

    # One process with 2 replicas would see, per step, process 0's micro-batch as replica 0's
    # and process 1's as replica 1's: the [D][G][R][B] layout interleaves the two shares.
    data = job.dataset(2)
    share = len(data) // 2
    call = job.D * job.G * job.B
    torch.manual_seed(0)
    plain = job.Net()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for c in range(job.CALLS):
        rows = [torch.arange(p * share + c * call, p * share + (c + 1) * call).view(-1, job.B)
                for p in range(2)]
        order = torch.stack(rows, dim=1).reshape(-1)  # [micro-batch][replica][B]
        x, labels = data.tensors[0][order], data.tensors[1][order]
        got = plain_train_call(plain, optimizer, x, labels, D=job.D, G=job.G, R=2)
        for p, result in enumerate(results):
            want = torch.stack([loss for _, r, _, loss in got if r == p])
            assert_close(result["losses"][c], want)
    for result in results:
        for name, value in plain.state_dict().items():
            assert_close(result["state"][name], value, msg=name)
