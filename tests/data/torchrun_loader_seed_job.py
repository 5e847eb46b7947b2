"""A torchrun job: shuffled DataLoaders in the processes of one pipeline, seeded per rank.

    torchrun --nnodes 2 --node-rank N --nproc-per-node 1 --master-addr 127.0.0.1 \\
        --master-port PORT tests/data/torchrun_loader_seed_job.py OUT_DIR

Each process seeds torch.manual_seed(100 + rank), as data-parallel scripts do, sets no
randomSeed, and saves the items of two epochs of a Sync and an Async DataLoader in OUT_DIR.
"""
import sys

import torch
from torch.utils.data import TensorDataset

import pipetorch as poptorch

MODES = (poptorch.DataLoaderMode.Sync, poptorch.DataLoaderMode.Async)


def two_epochs(opts: poptorch.Options, mode: poptorch.DataLoaderMode) -> list[list[int]]:
    loader = poptorch.DataLoader(opts, TensorDataset(torch.arange(40)), batch_size=2,
                                 shuffle=True, mode=mode)
    epochs = [[int(v) for (batch,) in loader for v in batch] for _ in range(2)]
    loader.terminate()
    return epochs


def main(out: str) -> None:
    opts = poptorch.Options().deviceIterations(2)
    opts.Distributed.stagesAcrossProcesses(True)
    process = opts.Distributed.processId
    torch.manual_seed(100 + process)
    result = {mode.name: two_epochs(opts, mode) for mode in MODES}
    result["next_random"] = float(torch.rand(()))  # the global RNGs advanced alike
    torch.save(result, f"{out}/process{process}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
