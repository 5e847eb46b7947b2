"""PopDist's view of a run (instances, replicas) read from the launcher's environment."""
from __future__ import annotations

import os
from collections.abc import Callable, Collection
from typing import ParamSpec, TypeVar

from pipetorch.errors import ConfigError
from pipetorch.options import environment

__all__ = [
    "IPUS_PER_REPLICA_VAR", "PROCESS_VARS", "TOTAL_REPLICAS_VAR", "checkNumIpusPerReplica",
    "execute_on_instances", "getInstanceIndex", "getLocalInstanceIndex", "getNumInstances",
    "getNumIpusPerReplica", "getNumLocalReplicas", "getNumTotalReplicas",
    "getReplicaIndexOffset", "init", "isPopdistEnvSet",
]

# PopRun's own names: `pipetorch run --num-replicas R [--ipus-per-replica K]` sets them.
TOTAL_REPLICAS_VAR = "POPDIST_NUM_TOTAL_REPLICAS"
IPUS_PER_REPLICA_VAR = "POPDIST_NUM_IPUS_PER_REPLICA"
# The variables by which a launcher (mpirun, torchrun) numbers its processes.
PROCESS_VARS = tuple(name for pair in environment.DEFAULT_PROCESS_VARS for name in pair)

T = TypeVar("T")
P = ParamSpec("P")


def _positive_env(var: str) -> int | None:
    raw = os.environ.get(var, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"Environment variable {var} must be an integer >= 1; got {raw!r}. "
                          "Fix it or unset it (pipetorch run --num-replicas sets it)")
    return value


def isPopdistEnvSet() -> bool:  # noqa: N802 - PopDist's name
    """Whether a launcher started this process: `pipetorch run --num-instances/--num-replicas`,
    torchrun or mpirun. False for a script run on its own."""
    return TOTAL_REPLICAS_VAR in os.environ or any(v in os.environ for v in PROCESS_VARS)


def getInstanceIndex() -> int:  # noqa: N802
    """This instance's index in [0, getNumInstances()): torchrun's RANK (mpirun's rank)."""
    return environment.process_from_env(None)[0]


def getNumInstances() -> int:  # noqa: N802
    """The number of instances: the launcher's processes (torchrun's WORLD_SIZE), else 1."""
    return environment.process_from_env(None)[1]


def getLocalInstanceIndex() -> int:  # noqa: N802
    """This instance's index among the instances of its host (torchrun's LOCAL_RANK), else 0."""
    return int(os.environ.get("LOCAL_RANK") or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK")
               or 0)


def getNumTotalReplicas() -> int:  # noqa: N802
    """The replicas of all instances together: `--num-replicas`, else one per instance."""
    instances = getNumInstances()
    total = _positive_env(TOTAL_REPLICAS_VAR)
    if total is None:
        return instances
    if total % instances:
        raise ConfigError(
            f"{TOTAL_REPLICAS_VAR}={total} replicas cannot be shared out evenly over "
            f"{instances} instances: give a --num-replicas that is a multiple of the number "
            f"of instances ({instances}), as PopRun requires")
    return total


def getNumLocalReplicas() -> int:  # noqa: N802
    """This instance's share of the replicas: getNumTotalReplicas() / getNumInstances()."""
    return getNumTotalReplicas() // getNumInstances()


def getReplicaIndexOffset() -> int:  # noqa: N802
    """The global index of this instance's first replica."""
    return getInstanceIndex() * getNumLocalReplicas()


def getNumIpusPerReplica() -> int:  # noqa: N802
    """The devices each replica spans: `--ipus-per-replica`, else 1."""
    return _positive_env(IPUS_PER_REPLICA_VAR) or 1


def checkNumIpusPerReplica(ipus_per_replica: int) -> bool:  # noqa: N802
    """False when the launcher was given another --ipus-per-replica than this one."""
    given = _positive_env(IPUS_PER_REPLICA_VAR)
    return given is None or given == ipus_per_replica


def init() -> None:
    """Check the launcher's environment (PopDist's start-up call; nothing else to start here).

    Raises ConfigError for values that cannot work, such as more instances than replicas.
    """
    getReplicaIndexOffset()
    getNumIpusPerReplica()


def execute_on_instances(instances: Collection[int], func: Callable[P, T], *args: P.args,
                         **kwargs: P.kwargs) -> T | None:
    """`func(*args, **kwargs)` on the instances whose index is in `instances`; None elsewhere.

    Unlike PopDist, collective calls inside `func` are not narrowed to those instances:
    `func` must not wait for the instances that skip it.
    """
    if getInstanceIndex() in instances:
        return func(*args, **kwargs)
    return None
