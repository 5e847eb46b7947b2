"""popdist.poptorch.Options: poptorch.Options already set for this instance of a launch."""
from __future__ import annotations

from typing import NoReturn

from pipetorch.options import Options as _PoptorchOptions
from pipetorch.options import _validate as check
from pipetorch.popdist import environment as env

__all__ = ["Options"]

_OWNER = "popdist.poptorch.Options"


def _blocked(call: str, why: str) -> NoReturn:
    raise RuntimeError(f"Cannot call `{call}` with {_OWNER}: {why}. Drop the call, or build "
                       "poptorch.Options() to choose it yourself")


class Options(_PoptorchOptions):
    """poptorch.Options for this instance: `replicationFactor` is its share of the launch's
    replicas (getNumLocalReplicas()) and `Distributed` its index among the instances.

    As in PopDist, `replicationFactor`, `useIpuId` and `Distributed`'s `configureProcessId`,
    `setEnvVarNames` and `disable` raise RuntimeError: the launcher decides them. A
    shuffling DataLoader over several instances needs no `randomSeed`: the instances agree
    on one seed (set `randomSeed` to choose it).
    """

    def __init__(self, ipus_per_replica: int | None = None) -> None:
        super().__init__()
        self._ipus_per_replica = self._checked_ipus(ipus_per_replica)
        env.init()
        self._values["replication_factor"] = env.getNumLocalReplicas()
        self.Distributed._own(_OWNER, env.getInstanceIndex(), env.getNumInstances())

    @staticmethod
    def _checked_ipus(ipus_per_replica: int | None) -> int:
        if ipus_per_replica is None:
            return env.getNumIpusPerReplica()
        ipus = check.integer(_OWNER, "ipus_per_replica", ipus_per_replica, minimum=1)
        if not env.checkNumIpusPerReplica(ipus):
            raise ValueError(
                f"{_OWNER}(ipus_per_replica={ipus}) disagrees with the launcher's "
                f"--ipus-per-replica ({env.getNumIpusPerReplica()}): pass the same number to "
                "both, or leave ipus_per_replica out to take the launcher's")
        return ipus

    @property
    def ipus_per_replica(self) -> int:
        """The devices each replica spans, as given here or to the launcher (1 by default)."""
        return self._ipus_per_replica

    def replicationFactor(self, replication_factor: int) -> NoReturn:
        """Refused: the launcher's --num-replicas sets the replicas (RuntimeError)."""
        _blocked("replicationFactor", f"this instance runs {env.getNumLocalReplicas()} of the "
                 f"launch's {env.getNumTotalReplicas()} replicas, set by --num-replicas")

    def useIpuId(self, ipu_id: int) -> NoReturn:
        """Refused: the launcher chooses the devices (RuntimeError)."""
        _blocked("useIpuId", "the launcher chooses each instance's devices")
