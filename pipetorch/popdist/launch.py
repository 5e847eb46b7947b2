"""PopRun's launch on torchrun: N instances on this host, each told its share of R replicas."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from pipetorch.popdist import environment as env

__all__ = ["POPRUN_ONLY", "export", "launched", "start_instances", "torchrun_argv"]

_ON_HOSTS = ("start torchrun on each host: `torchrun --nnodes H --node-rank I "
             "--nproc-per-node N --master-addr HOST0 --master-port PORT -m pipetorch run "
             "--num-replicas R script.py`")
# PopRun's flags that have no meaning for `pipetorch run`, and what to use instead.
POPRUN_ONLY = {
    "--host": _ON_HOSTS,
    "-H": _ON_HOSTS,
    "--hostfile": _ON_HOSTS,
    "--num-ilds": "IPU-Link domains do not exist here; " + _ON_HOSTS,
    "--vipu-partition": "there are no V-IPU partitions: each instance uses this host's "
                        "GPUs or CPU cores (PIPETORCH_DEVICE, PIPETORCH_NUM_DEVICES)",
    "--vipu-allocation": "there are no V-IPU allocations: each instance uses this host's "
                         "GPUs or CPU cores (PIPETORCH_DEVICE, PIPETORCH_NUM_DEVICES)",
    "--vipu-server-host": "there is no V-IPU server: torchrun's --master-addr / "
                          "--master-port name the host where the instances meet",
    "--mpi-global-args": "instances are torchrun processes, not MPI ranks: pass torchrun's "
                         "own flags (e.g. --log-dir, --tee) by starting torchrun yourself",
    "--mpi-local-args": "instances are torchrun processes, not MPI ranks: set environment "
                        "variables before `pipetorch run` (its instances inherit them)",
    "--executable-cache-path": "set POPTORCH_CACHE_DIR before `pipetorch run`",
}


def launched() -> bool:
    """Whether this process is one of a launcher's (torchrun, mpirun) processes."""
    return any(var in os.environ for var in env.PROCESS_VARS)


def torchrun_argv(num_instances: int, script: str, args: Sequence[str], *,
                  num_replicas: int | None, ipus_per_replica: int | None) -> list[str]:
    """The command starting `num_instances` torchrun processes here, each running
    `pipetorch run [--num-replicas R] [--ipus-per-replica K] script args...`."""
    inner = ["run"]
    if num_replicas is not None:
        inner += ["--num-replicas", str(num_replicas)]
    if ipus_per_replica is not None:
        inner += ["--ipus-per-replica", str(ipus_per_replica)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(num_instances), "-m", "pipetorch", *inner, script, *args]


def start_instances(num_instances: int, script: str, args: Sequence[str], *,
                    num_replicas: int | None, ipus_per_replica: int | None) -> int:
    """Run the instances through torchrun and wait for them: torchrun's exit code."""
    if num_replicas is not None and num_replicas % num_instances:
        raise ValueError(
            f"--num-replicas ({num_replicas}) must be a multiple of --num-instances "
            f"({num_instances}), as in PopRun: every instance runs the same number of "
            "replicas")
    argv = torchrun_argv(num_instances, script, args, num_replicas=num_replicas,
                         ipus_per_replica=ipus_per_replica)
    return subprocess.call(argv)


def export(*, num_instances: int | None, num_replicas: int | None,
           ipus_per_replica: int | None) -> None:
    """Tell this process (and its children) its launch's replicas, as PopRun's variables.

    Raises ValueError (ConfigError) when the values cannot work in this launch.
    """
    instances = env.getNumInstances()
    if num_instances is not None and num_instances != instances:
        raise ValueError(
            f"--num-instances {num_instances} was given inside a launch of {instances} "
            "processes: drop --num-instances (torchrun's --nnodes x --nproc-per-node count "
            "the instances) or make them agree")
    if num_replicas is not None:
        os.environ[env.TOTAL_REPLICAS_VAR] = str(num_replicas)
    if ipus_per_replica is not None:
        os.environ[env.IPUS_PER_REPLICA_VAR] = str(ipus_per_replica)
    env.init()
