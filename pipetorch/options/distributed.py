"""Options.Distributed: this process's id and the process count, set or read from env."""
from __future__ import annotations

from typing import Any, ClassVar

from pipetorch.options import _validate as check
from pipetorch.options import environment
from pipetorch.options._group import OptionGroup

__all__ = ["_DistributedOptions"]


class _DistributedOptions(OptionGroup):
    """Which of several host processes this one is: `opts.Distributed.configureProcessId(0, 2)`.

    `configureProcessId` wins. Otherwise the values come from the environment, read when
    asked: the variables named by `setEnvVarNames`, or by default OpenMPI's
    OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_RANK, then torchrun's WORLD_SIZE / RANK,
    else a single process (0 of 1).
    """

    _LABEL = "Options.Distributed"
    _DEFAULTS: ClassVar[dict[str, Any]] = {"configured": None, "env_var_names": None,
                                           "across": False, "owner": None}

    def _refuse_if_owned(self, call: str) -> None:
        owner = self._values["owner"]
        if owner is not None:
            raise RuntimeError(
                f"Cannot call `Distributed.{call}` with {owner}: the launcher set this "
                f"process's id ({self.process_id}) and the process count "
                f"({self.num_processes}). Drop the call, or use poptorch.Options() to set them "
                "yourself")

    def _own(self, owner: str, process_id: int, num_processes: int) -> None:
        """Fix the id and count for `owner` (popdist.poptorch.Options), whose instances also
        agree on one shuffle seed; the public setters are refused from now on."""
        self.configureProcessId(process_id, num_processes)
        self._set(owner=owner)

    @property
    def _agrees_on_shuffle_seed(self) -> bool:
        """Whether a DataLoader shuffling over the processes without `randomSeed` draws one
        seed that all of them agree on (popdist.poptorch.Options), rather than refusing."""
        return self._values["owner"] is not None

    def _resolved(self) -> tuple[int, int]:
        if self._values["configured"] is not None:
            return self._values["configured"]
        return environment.process_from_env(self._values["env_var_names"])

    @property
    def process_id(self) -> int:
        """Id of this process, in [0, num_processes)."""
        return self._resolved()[0]

    @property
    def num_processes(self) -> int:
        """Number of processes the run is distributed over."""
        return self._resolved()[1]

    @property
    def processId(self) -> int:
        """Id of this process (PopTorch's name for `process_id`)."""
        return self.process_id

    @property
    def numProcesses(self) -> int:
        """Number of processes (PopTorch's name for `num_processes`)."""
        return self.num_processes

    @property
    def distributed_process_id(self) -> int:
        """Id of this process (PopTorch's option name)."""
        return self.process_id

    @property
    def num_distributed_processes(self) -> int:
        """Number of processes (PopTorch's option name)."""
        return self.num_processes

    def configureProcessId(self, process_id: int,
                           num_processes: int) -> _DistributedOptions:
        """Set this process's id and the process count; takes precedence over the environment."""
        self._refuse_if_owned("configureProcessId")
        num_processes = check.integer(
            "configureProcessId", "num_processes", num_processes, minimum=1)
        process_id = check.integer("configureProcessId", "process_id", process_id, minimum=0)
        if process_id >= num_processes:
            raise check.value_error("configureProcessId", "process_id", process_id,
                                    f"< num_processes ({num_processes})")
        self._set(configured=(process_id, num_processes))
        return self

    def setEnvVarNames(self, var_num_processes: str,
                       var_process_id: str) -> _DistributedOptions:
        """Read the process count and id from these environment variables (e.g. for mpirun).

        Unset variables mean 1 process / id 0. The values are checked now.
        """
        self._refuse_if_owned("setEnvVarNames")
        names = (check.text("setEnvVarNames", "var_num_processes", var_num_processes),
                 check.text("setEnvVarNames", "var_process_id", var_process_id))
        environment.process_from_env(names)
        self._set(env_var_names=names)
        return self

    @property
    def stages_across_processes(self) -> bool:
        """Whether the processes run one pipeline together (`stagesAcrossProcesses`)."""
        return self._values["across"]

    @property
    def data_share(self) -> tuple[int, int]:
        """(share, shares) of the data this process reads: one pipeline's processes read the
        same share, so with `stagesAcrossProcesses` every process reads the whole data."""
        return (0, 1) if self.stages_across_processes else self._resolved()

    def stagesAcrossProcesses(self, enabled: bool = True) -> _DistributedOptions:
        """One pipeline over all the processes (a pipetorch extension): devices are numbered
        across them, process p holding ipus p*k .. p*k + k - 1 of every replica (k: the
        model's ipus / processes); every process passes the same inputs and gets the outputs
        (docs/machines.md, "One pipeline over several machines")."""
        self._set(across=check.boolean("stagesAcrossProcesses", "enabled", enabled))
        return self

    def disable(self) -> _DistributedOptions:
        """Ignore the environment: run as the only process (0 of 1)."""
        self._refuse_if_owned("disable")
        self._set(configured=(0, 1))
        return self

    def _export(self) -> dict[str, Any]:
        names = self._values["env_var_names"]
        return {"process_id": self.process_id, "num_processes": self.num_processes,
                "env_var_names": list(names) if names else None,
                "stages_across_processes": self.stages_across_processes}
