"""The shuffle seed that the processes of one pipeline (stagesAcrossProcesses) agree on."""
from __future__ import annotations

import datetime
import itertools
import os
from typing import TYPE_CHECKING

import torch

from pipetorch import environment
from pipetorch.errors import LoaderError
from pipetorch.parallel.comm import rendezvous

if TYPE_CHECKING:
    from pipetorch.options import Options

__all__: list[str] = []

_exchanges = itertools.count(1)  # every process runs the same script: the n-th agrees with the n-th


def shuffle_generator(options: Options) -> torch.Generator | None:
    """Where a shuffled DataLoader draws its orders from: the global RNG (None) in one process,
    as PopTorch does; across the processes of one pipeline, a generator seeded alike in all
    of them, from `randomSeed` or else from the seed they agree on now."""
    distributed = options.Distributed
    if not distributed.stages_across_processes or distributed.num_processes == 1:
        return None
    seed = options.random_seed
    if seed is None:
        seed = agreed_seed(distributed.process_id, distributed.num_processes)
    return torch.Generator().manual_seed(int(seed))


def agreed_seed(process_id: int, num_processes: int) -> int:
    """Process 0's draw from its global RNG, read by the others through the job's store.

    Every process draws one number, so the processes' global RNGs advance alike (a script
    seeding them alike still builds the same weights everywhere); only process 0's is used.
    """
    drawn = int(torch.empty((), dtype=torch.int64).random_().item())
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"pipetorch/loader-seed/{restart}/{next(_exchanges)}"
    timeout = environment.get("timeout")
    try:
        store = rendezvous.host_store(process_id, num_processes, timeout)
        if process_id == 0:
            store.set(key, str(drawn))
            return drawn
        store.wait([key], datetime.timedelta(seconds=timeout))
        return int(store.get(key))
    except RuntimeError as error:  # torch's DistStoreError / DistNetworkError: a timeout
        raise LoaderError(
            f"Process {process_id} of {num_processes} waited {timeout:g} s for process 0 to "
            f"share the shuffle seed of its DataLoader number {key.rsplit('/', 1)[1]} "
            f"(store key {key!r}) and got no answer ({error}). Every process must create the "
            "same DataLoaders in the same order; or set options.randomSeed(N) with the same N "
            "in every process, which needs no exchange. Raise PIPETORCH_TIMEOUT if process 0 "
            "is only slow.") from error
