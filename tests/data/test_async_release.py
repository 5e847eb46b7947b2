"""release_after: a slot still read by a non_blocking copy goes back to the loader only after
the copy's event completed (the slot is pinned; a GPU copy from it returns at once)."""
import pytest
import torch
from loader_datasets import IncrementDataset, values

import pipetorch as poptorch
from pipetorch.data.ring_buffer import Msg

Async = poptorch.DataLoaderMode.Async


class FakeEvent:
    """torch.cuda.Event's query()/synchronize(): done once `finish()` or synchronize() ran."""

    def __init__(self):
        self.done, self.synchronized = False, 0

    def query(self):
        return self.done

    def synchronize(self):
        self.synchronized += 1
        self.done = True


@pytest.fixture
def loader(request):
    made = poptorch.DataLoader(poptorch.Options(), IncrementDataset(12), batch_size=1,
                               mode=Async, async_options={"buffer_size": 3})
    request.addfinalizer(made.terminate)
    return made


def spy_on_frees(accessor, events):
    """Record, for each slot handed back, (its copy had finished, times it was waited on)."""
    freed, send = [], accessor._send

    def spy(kind, *payload):
        if kind == Msg.FREE:
            event = events.pop(payload[0])
            freed.append((event.done, event.synchronized))
        send(kind, *payload)

    accessor._send = spy
    return freed


@pytest.mark.parametrize("finished", ["odd", "all"])
def test_a_slot_goes_back_only_once_its_copy_event_completed(loader, finished):
    # benchmarks/gpu.py copied a batch non_blocking from its pinned slot, and the next
    # __next__ handed the slot back for refilling while the copy could still be reading it
    it = iter(loader)
    accessor = loader._accessor
    events = {}
    freed = spy_on_frees(accessor, events)
    for step in range(12):
        assert values(next(it)) == [step]
        events[accessor._held] = event = FakeEvent()
        loader.release_after(event)
        event.done = finished == "all" or step % 2 == 1  # these copies finish by themselves
    # all but the held slot and the (at most 2) others behind an unfinished copy went back
    assert len(freed) >= 12 - 3
    assert all(done for done, _ in freed)  # never recycled under a running copy
    if finished == "all":  # nothing to wait for: no event was waited on
        assert freed == [(True, 0)] * len(freed)


def test_with_nothing_ready_the_oldest_copy_is_waited_for_and_its_slot_freed():
    # one slot: while its copy runs the loader has nowhere to load, so nothing can be ready
    # and next() must wait for the copy's event instead of waiting for the loader forever
    accessor = poptorch.AsynchronousDataAccessor(IncrementDataset(6), buffer_size=1)
    events = []
    try:
        it = iter(accessor)
        for expected in range(6):
            assert int(next(it)[0, 0]) == expected
            events.append(FakeEvent())
            accessor.release_after(events[-1])
        assert [e.synchronized for e in events[:-1]] == [1] * 5
    finally:
        accessor.terminate()
    assert events[-1].synchronized == 1  # terminating waits before the buffer is released


def test_release_after_without_a_held_batch_says_when_to_call_it(loader):
    iter(loader)
    with pytest.raises(ValueError, match=r"call it after next\(\)"):
        loader.release_after(FakeEvent())
