"""A training job for torchrun: each node process trains its replica on its share of the data.

    torchrun --nnodes 2 --node-rank N --nproc-per-node 1 --master-addr 127.0.0.1 \\
        --master-port PORT tests/parallel/torchrun_job.py OUT_DIR
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import pipetorch as poptorch

D, G, B, CALLS = 2, 2, 2, 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x, labels):
        out = self.b(torch.tanh(self.a(x)))
        return out, F.cross_entropy(out, labels)


def dataset(processes: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = processes * CALLS * D * G * B
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def main(out: str) -> None:
    opts = poptorch.Options().deviceIterations(D).showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All)
    process, processes = opts.Distributed.processId, opts.Distributed.numProcesses
    loader = poptorch.DataLoader(opts, dataset(processes), batch_size=B, shuffle=False)
    torch.manual_seed(0)
    model = Net()
    wrapper = poptorch.trainingModel(model, opts,
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    losses = [wrapper(x, labels)[1].as_subclass(torch.Tensor) for x, labels in loader]
    workers = len(wrapper._compiled.engine.worker_pids)
    wrapper.destroy()
    torch.save({"process": process, "processes": processes, "workers": workers,
                "losses": losses, "state": model.state_dict()}, f"{out}/process{process}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
