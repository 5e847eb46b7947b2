"""Outputs for the host: non_blocking copies during the call, one event waited on at its end."""
import torch

from pipetorch.parallel.worker.host_copies import HostCopies


class FakeEvent:
    """torch.cuda.Event's record/synchronize, counted in `log`."""

    log: list[str] = []

    def record(self):
        FakeEvent.log.append("record")

    def synchronize(self):
        FakeEvent.log.append("synchronize")


def test_copies_made_during_a_call_are_waited_for_by_one_event():
    # outputs were copied with a blocking .to("cpu") mid-schedule: each one drained the GPU
    FakeEvent.log = []
    copies = HostCopies(event=FakeEvent)
    values = [torch.arange(6.).view(2, 3).requires_grad_(), torch.ones(4, dtype=torch.int64)]
    taken = [copies.take(v) for v in values]
    assert FakeEvent.log == []  # nothing waits while the schedule runs
    copies.ready()
    assert FakeEvent.log == ["record", "synchronize"]
    for got, value in zip(taken, values):
        assert got.data_ptr() != value.data_ptr() and not got.requires_grad
        torch.testing.assert_close(got, value.detach(), rtol=0, atol=0)
    copies.ready()  # no copy since: no event
    assert FakeEvent.log == ["record", "synchronize"]


def test_values_that_are_not_tensors_pass_unchanged_without_an_event():
    FakeEvent.log = []
    copies = HostCopies(event=FakeEvent)
    assert copies.take(3) == 3 and copies.take("x") == "x"
    copies.ready()
    assert FakeEvent.log == []


def test_on_the_cpu_values_are_handed_over_without_a_copy():
    copies = HostCopies.for_device(torch.device("cpu"))
    value = torch.randn(3, requires_grad=True) * 2
    got = copies.take(value)
    assert not got.requires_grad and got.data_ptr() == value.data_ptr()
    copies.ready()  # no event to wait on
