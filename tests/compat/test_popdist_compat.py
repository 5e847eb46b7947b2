"""pipetorch.popdist answers PopDist's functions from the launcher's environment; its
Options are set for the instance and refuse what the launcher decides, as PopTorch's do."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import pipetorch as poptorch
import pipetorch.popdist as popdist
from pipetorch.data import shared_seed
from pipetorch.errors import ConfigError

VARS = ("POPDIST_NUM_TOTAL_REPLICAS", "POPDIST_NUM_IPUS_PER_REPLICA", "WORLD_SIZE", "RANK",
        "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")


@pytest.fixture
def launch(monkeypatch: pytest.MonkeyPatch):
    """Set a launch's variables: launch(RANK=1, WORLD_SIZE=2, ...); none are set before."""
    for var in VARS:
        monkeypatch.delenv(var, raising=False)

    def set_vars(**values: object) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))
    return set_vars


def answers() -> tuple:
    return (popdist.isPopdistEnvSet(), popdist.getInstanceIndex(), popdist.getNumInstances(),
            popdist.getNumTotalReplicas(), popdist.getNumLocalReplicas(),
            popdist.getReplicaIndexOffset(), popdist.getNumIpusPerReplica())


def test_without_a_launcher_one_instance_of_one_replica(launch) -> None:
    launch()
    assert answers() == (False, 0, 1, 1, 1, 0, 1)
    assert popdist.getLocalInstanceIndex() == 0


def test_instances_share_the_total_replicas(launch) -> None:
    launch(WORLD_SIZE=2, RANK=1, LOCAL_RANK=1, POPDIST_NUM_TOTAL_REPLICAS=8,
           POPDIST_NUM_IPUS_PER_REPLICA=2)
    assert answers() == (True, 1, 2, 8, 4, 4, 2)
    assert popdist.getLocalInstanceIndex() == 1
    assert popdist.checkNumIpusPerReplica(2) and not popdist.checkNumIpusPerReplica(4)


def test_torchrun_alone_gives_one_replica_per_process(launch) -> None:
    launch(WORLD_SIZE=3, RANK=2)
    assert answers() == (True, 2, 3, 3, 1, 2, 1)


def test_replicas_alone_are_one_instance(launch) -> None:
    launch(POPDIST_NUM_TOTAL_REPLICAS=4)  # `pipetorch run --num-replicas 4` without torchrun
    assert answers() == (True, 0, 1, 4, 4, 0, 1)


@pytest.mark.parametrize("values, message", [
    ({"WORLD_SIZE": 2, "POPDIST_NUM_TOTAL_REPLICAS": 3},
     "POPDIST_NUM_TOTAL_REPLICAS=3 replicas cannot be shared out evenly over 2 instances: give "
     "a --num-replicas that is a multiple of the number of instances (2)"),
    ({"POPDIST_NUM_TOTAL_REPLICAS": "four"},
     "Environment variable POPDIST_NUM_TOTAL_REPLICAS must be an integer >= 1; got 'four'"),
    ({"POPDIST_NUM_IPUS_PER_REPLICA": 0},
     "Environment variable POPDIST_NUM_IPUS_PER_REPLICA must be an integer >= 1; got '0'"),
])
def test_init_refuses_a_launch_that_cannot_work(launch, values: dict, message: str) -> None:
    launch(**values)
    with pytest.raises(ConfigError) as error:
        popdist.init()
    assert message in str(error.value)


def test_execute_on_instances_runs_only_there(launch) -> None:
    launch(WORLD_SIZE=2, RANK=1)
    assert popdist.execute_on_instances({1}, lambda a, *, b: a + b, 1, b=2) == 3
    assert popdist.execute_on_instances({0}, lambda: 1) is None


def test_options_are_set_for_the_instance(launch) -> None:
    launch(WORLD_SIZE=2, RANK=1, POPDIST_NUM_TOTAL_REPLICAS=4)
    opts = popdist.poptorch.Options(ipus_per_replica=1)
    assert isinstance(opts, poptorch.Options)
    assert (opts.replication_factor, opts.Distributed.processId,
            opts.Distributed.numProcesses, opts.ipus_per_replica) == (2, 1, 2, 1)
    copy = opts.clone()
    assert (type(copy), copy.replication_factor) == (type(opts), 2)
    with pytest.raises(RuntimeError, match=r"Cannot call `replicationFactor` with "
                                           r"popdist\.poptorch\.Options"):
        copy.replicationFactor(1)


def test_options_without_a_launcher_are_one_process(launch) -> None:
    launch()
    opts = popdist.poptorch.Options(ipus_per_replica=2)
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (0, 1)
    assert opts.replication_factor == 1


# PopTorch's own test of popdist.poptorch.Options (test_blocked_options) expects these
# RuntimeErrors and their opening words.
@pytest.mark.parametrize("call, name", [
    (lambda o: o.replicationFactor(1), "replicationFactor"),
    (lambda o: o.useIpuId(1), "useIpuId"),
    (lambda o: o.Distributed.disable(), "Distributed.disable"),
    (lambda o: o.Distributed.setEnvVarNames("A", "B"), "Distributed.setEnvVarNames"),
    (lambda o: o.Distributed.configureProcessId(1, 2), "Distributed.configureProcessId"),
])
def test_options_refuse_what_the_launcher_decides(launch, call, name: str) -> None:
    launch(WORLD_SIZE=2, RANK=0, POPDIST_NUM_TOTAL_REPLICAS=4)
    opts = popdist.poptorch.Options()
    with pytest.raises(RuntimeError, match=rf"^Cannot call `{name}` with "
                                           r"popdist\.poptorch\.Options: .+ Drop the call"):
        call(opts)
    assert (opts.replication_factor, opts.Distributed.numProcesses) == (2, 2)


def test_ipus_per_replica_must_match_the_launchers(launch) -> None:
    launch(POPDIST_NUM_IPUS_PER_REPLICA=2)
    assert popdist.poptorch.Options().ipus_per_replica == 2
    with pytest.raises(ValueError, match=r"ipus_per_replica=4\) disagrees with the launcher's "
                                         r"--ipus-per-replica \(2\)"):
        popdist.poptorch.Options(ipus_per_replica=4)


def numbered(size: int) -> TensorDataset:
    return TensorDataset(torch.arange(size, dtype=torch.float32).unsqueeze(1))


def read_epoch(loader: poptorch.DataLoader) -> list[int]:
    return [int(v) for (x,) in loader for v in x.view(-1)]


def test_instances_read_contiguous_blocks(launch) -> None:
    launch(WORLD_SIZE=2, RANK=1, POPDIST_NUM_TOTAL_REPLICAS=4)
    loader = poptorch.DataLoader(popdist.poptorch.Options(), numbered(20), batch_size=2,
                                 auto_distributed_partitioning=True)
    # 20 items, steps of 2 x 2 local replicas over 2 instances: 16 used, instance 1 has 8..15
    assert read_epoch(loader) == list(range(8, 16))


def test_shuffled_instances_read_their_block_of_one_permutation(launch) -> None:
    launch(WORLD_SIZE=2, RANK=1, POPDIST_NUM_TOTAL_REPLICAS=4)
    opts = popdist.poptorch.Options().randomSeed(5)
    loader = poptorch.DataLoader(opts, numbered(16), batch_size=2, shuffle=True)
    generator = torch.Generator().manual_seed(5)
    for _ in range(2):
        assert read_epoch(loader) == torch.randperm(16, generator=generator)[8:].tolist()


def test_shuffled_instances_without_a_seed_agree_on_one(launch,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    launch(WORLD_SIZE=2, RANK=0, POPDIST_NUM_TOTAL_REPLICAS=2)
    asked = []

    def agreed_seed(process_id: int, num_processes: int) -> int:
        asked.append((process_id, num_processes))
        return 9
    monkeypatch.setattr(shared_seed, "agreed_seed", agreed_seed)
    loader = poptorch.DataLoader(popdist.poptorch.Options(), numbered(8), batch_size=2,
                                 shuffle=True)
    assert asked == [(0, 2)]
    assert read_epoch(loader) == torch.randperm(8, generator=torch.Generator().manual_seed(9))[
        :4].tolist()
    # plain Options over processes still ask for randomSeed, as before
    with pytest.raises(ValueError, match="randomSeed"):
        poptorch.DataLoader(poptorch.Options(), numbered(8), batch_size=2, shuffle=True)
