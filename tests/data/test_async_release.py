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


def test_a_slot_goes_back_only_once_its_copy_event_completed(loader):
    # benchmarks/gpu.py copied a batch non_blocking from its pinned slot, and the next
    # __next__ handed the slot back for refilling while the copy could still be reading it
    it = iter(loader)
    accessor = loader._accessor
    events, freed, send = {}, [], accessor._send

    def spy(kind, *payload):  # each slot handed back, and whether its copy had finished
        if kind == Msg.FREE:
            event = events.pop(payload[0])
            freed.append((event.done, event.synchronized))
        send(kind, *payload)

    accessor._send = spy
    for step in range(12):
        assert values(next(it)) == [step]
        events[accessor._held] = event = FakeEvent()
        loader.release_after(event)
        event.done = step % 2 == 1  # odd copies finish by themselves, even ones need waiting
    assert len(freed) >= 9
    assert all(done for done, _ in freed)  # never recycled under a running copy
    assert (True, 0) in freed  # a finished copy's slot went back without waiting on it


def test_with_nothing_ready_the_oldest_copy_is_waited_for_and_its_slot_freed():
    accessor = poptorch.AsynchronousDataAccessor(IncrementDataset(8), buffer_size=2)
    try:
        it = iter(accessor)
        events = []
        for expected in range(8):  # every slot held behind an unfinished event in turn
            assert int(next(it)[0, 0]) == expected
            events.append(FakeEvent())
            accessor.release_after(events[-1])
        assert all(e.done for e in events[:-1])  # the loader never ran out of slots for good
        assert sum(e.synchronized for e in events) >= 1
    finally:
        accessor.terminate()
    assert events[-1].synchronized == 1  # terminating waits before the buffer is released


def test_release_after_without_a_held_batch_says_when_to_call_it(loader):
    iter(loader)
    with pytest.raises(ValueError, match=r"call it after next\(\)"):
        loader.release_after(FakeEvent())
