"""The compile plan as data: each stage's device and the micro-batches each lane stashes."""
import dataclasses

import pytest

from pipetorch.parallel.layout.compile_plan import CompilePlan
from pipetorch.parallel.layout.placement import Placement
from pipetorch.partition.strategies import StageSpec
from pipetorch.schedule.device_plans import peak_stash

# ipus 0, 1, 0: stages 0 and 2 share device 0's worker
STAGES = (StageSpec(0, 0, ("A",)), StageSpec(1, 1, ("B",)), StageSpec(2, 0, ("C",)))


def workers(replicas: int) -> CompilePlan:
    placements = tuple(Placement(stages, ipu, "cpu", 1, replica) for replica in range(replicas)
                       for stages, ipu in (((0, 2), 0), ((1,), 1)))
    return CompilePlan(STAGES, 2 * replicas, "pipelined", placements)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_stage_belongs_to_its_workers_place_in_a_replica(replicas):
    plan = workers(replicas)
    assert not plan.local and plan.owners == (0, 1, 0)


def test_a_workers_plan_stashes_what_the_schedule_it_runs_stashes():
    plan = workers(1)
    assert plan.in_flight(6, training=True) == peak_stash("pipelined", 3, 6, (0, 1, 0))
    # pipelineSchedule("auto") changes the engine's schedule as it runs
    assert plan.in_flight(6, training=True, schedule="zero_bubble") == \
        peak_stash("zero_bubble", 3, 6, (0, 1, 0))
    assert plan.in_flight(6, training=False) == (0, 0, 0)


def test_a_local_plan_is_one_lane_running_each_micro_batch_in_turn():
    plan = CompilePlan(STAGES, 2)
    assert plan.local and plan.owners == (0, 0, 0) and plan.graphs is None
    assert plan.in_flight(6, training=True) == peak_stash("sharded", 1, 6) == (1,)


def test_the_plan_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        workers(1).schedule = "sharded"  # type: ignore[misc]
