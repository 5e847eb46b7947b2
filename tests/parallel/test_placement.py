"""Placements: one worker per logical device and replica, holding every stage on that device."""
from pipetorch.parallel.layout import placement
from pipetorch.parallel.layout.placement import Physical, Placement
from pipetorch.partition.strategies import StageSpec


def specs(ipus):
    return [StageSpec(i, ipu, (f"B{i}",)) for i, ipu in enumerate(ipus)]


def test_six_stages_on_two_ipus_get_two_cpu_workers_sharing_the_cores(monkeypatch):
    monkeypatch.setattr(placement, "physical", lambda: Physical(("cpu",), 8, None))
    assert placement.place(specs([0, 0, 0, 1, 1, 1])) == [
        Placement((0, 1, 2), 0, "cpu", 4), Placement((3, 4, 5), 1, "cpu", 4)]


def test_ipus_0_1_0_put_stages_0_and_2_in_one_worker_per_replica(monkeypatch):
    monkeypatch.setattr(placement, "physical", lambda: Physical(("cpu",), 8, None))
    assert placement.place(specs([0, 1, 0]), replicas=2) == [
        Placement((0, 2), 0, "cpu", 2, 0), Placement((1,), 1, "cpu", 2, 0),
        Placement((0, 2), 0, "cpu", 2, 1), Placement((1,), 1, "cpu", 2, 1)]


def test_each_device_worker_takes_the_next_gpu_replica_major(monkeypatch):
    gpus = tuple(f"cuda:{i}" for i in range(4))
    monkeypatch.setattr(placement, "physical", lambda: Physical(gpus, 16, None))
    placed = placement.place(specs([2, 2, 5]), replicas=2)  # ipus 2 and 5: devices 0 and 1
    assert [(p.stages, p.ipu, p.device, p.replica, p.threads) for p in placed] == [
        ((0, 1), 2, "cuda:0", 0, 4), ((2,), 5, "cuda:1", 0, 4),
        ((0, 1), 2, "cuda:2", 1, 4), ((2,), 5, "cuda:3", 1, 4)]
