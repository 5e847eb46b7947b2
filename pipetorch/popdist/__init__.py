"""PopDist, Graphcore's API of multi-instance runs, answered from torchrun's environment.

An instance is one process of the launch (`pipetorch run --num-instances N`, torchrun or
mpirun); `pipetorch run --num-replicas R` shares R replicas out over them. Under
`pipetorch run`, `import popdist` gives this package (docs/machines.md, "PopRun and PopDist").
"""
from pipetorch.popdist import poptorch
from pipetorch.popdist.environment import (
    checkNumIpusPerReplica, execute_on_instances, getInstanceIndex, getLocalInstanceIndex,
    getNumInstances, getNumIpusPerReplica, getNumLocalReplicas, getNumTotalReplicas,
    getReplicaIndexOffset, init, isPopdistEnvSet,
)

__all__ = [
    "checkNumIpusPerReplica", "execute_on_instances", "getInstanceIndex",
    "getLocalInstanceIndex", "getNumInstances", "getNumIpusPerReplica", "getNumLocalReplicas",
    "getNumTotalReplicas", "getReplicaIndexOffset", "init", "isPopdistEnvSet", "poptorch",
]
