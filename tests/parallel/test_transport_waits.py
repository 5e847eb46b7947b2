"""How PeerLink waits for torch.distributed work: bounded on gloo, stream-ordered on NCCL."""
import datetime
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from pipetorch.errors import DeviceError
from pipetorch.parallel.layout.routes import TensorSpec
from pipetorch.parallel.comm.transport import BundleLayout, PeerLink, Tag

CPU = torch.device("cpu")
LAYOUT = BundleLayout((TensorSpec((2, 3), torch.float32, False),))


class FakeWork:
    """dist.Work's wait: records how it was called; `done` is what a timed wait returns."""

    def __init__(self, done=True):
        self.done, self.calls = done, []

    def wait(self, *args):
        self.calls.append(args)
        return self.done


def link(backend):
    return PeerLink(device=CPU, wire_device=CPU, timeout=7, backend=backend)


def test_an_nccl_receive_waits_without_a_timeout():
    # ProcessGroupNCCL's wait(timeout) spins the CPU until the kernel ends, after draining the
    # compute stream: every receive stalled the GPU (gpu-review #7). wait() only orders streams.
    work = FakeWork(done=False)  # a timed wait would have failed: it must not be used
    with mock.patch.object(dist, "irecv", return_value=work):
        tensors = link("nccl").recv(LAYOUT, 1, Tag.ACTIVATIONS)
    assert work.calls == [()]
    assert [t.shape for t in tensors] == [torch.Size([2, 3])]


def test_nccl_sends_and_all_reduces_wait_without_a_timeout():
    nccl, works = link("nccl"), [FakeWork(), FakeWork()]
    with mock.patch.object(dist, "isend", return_value=works[0]), \
            mock.patch.object(dist, "all_reduce", return_value=works[1]):
        nccl.send(LAYOUT, [torch.ones(2, 3)], 1, Tag.ACTIVATIONS)
        nccl.all_reduce([torch.ones(4)])
        nccl.flush()
    assert [w.calls for w in works] == [[()], [()]]


def test_a_gloo_receive_waits_at_most_the_timeout_and_names_the_peer():
    work = FakeWork(done=False)
    with mock.patch.object(dist, "irecv", return_value=work):
        with pytest.raises(DeviceError, match=r"No data from the worker of device 1 within 7s "
                                              r"\(PIPETORCH_TIMEOUT\)"):
            link("gloo").recv(LAYOUT, 1, Tag.ACTIVATIONS)
    assert work.calls == [(datetime.timedelta(seconds=7),)]


def test_gloo_sends_wait_with_the_timeout_at_flush():
    gloo, work = link("gloo"), FakeWork()
    with mock.patch.object(dist, "isend", return_value=work):
        gloo.send(LAYOUT, [torch.ones(2, 3)], 1, Tag.ACTIVATIONS)
        assert work.calls == []  # asynchronous until the step's flush
        gloo.flush()
    assert work.calls == [(datetime.timedelta(seconds=7),)]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_traces_name_the_real_backend(backend):
    # traces said "gloo" for NCCL transfers (gpu-review, "Checked, not bugs")
    assert link(backend).kind == backend
