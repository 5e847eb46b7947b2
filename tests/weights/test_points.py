"""The record of which point of training each copy holds (weights.points)."""
from pipetorch.weights.points import Points


def test_calls_uploads_reads_and_snapshots_move_the_points():
    points = Points()
    points.started(saved=True)
    assert points.behind() == 0 and points.host_current(optimizer_state=True) is False
    points.changed(saved=False)  # a training call the workers did not write
    assert (points.workers, points.saved, points.host) == (1, 0, 0)
    assert points.behind() == 1 and not points.host_current(optimizer_state=False)
    points.pulled(optimizer_state=True)  # read: weights and the optimiser's state, moved
    assert points.host_current(optimizer_state=True) and points.state_on_host
    points.changed(saved=True, uploaded=True)  # copyWeightsToDevice: the host copy is it
    assert (points.workers, points.saved, points.host) == (2, 2, 2)
    assert points.host_current(optimizer_state=False)
    points.started(saved=False)  # new workers: nothing written, the state on them
    assert points.behind() is None and not points.state_on_host
