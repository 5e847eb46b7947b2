"""A torchrun job whose processes each run 2 replicas, optimiser state sharded over them.

    torchrun --nnodes 2 --node-rank N --nproc-per-node 1 --master-addr 127.0.0.1 \\
        --master-port PORT tests/parallel/torchrun_sharded_job.py OUT_DIR
"""
import sys

import torch

import pipetorch as poptorch
from torchrun_job import B, CALLS, D, G, Net, dataset

R = 2  # replicas of each process


def main(out: str) -> None:
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    opts.showCompilationProgressBar(False).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(G)
    opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings().useReplicatedTensorSharding(True)
        .minElementsForReplicatedTensorSharding(0))
    process, processes = opts.Distributed.processId, opts.Distributed.numProcesses
    loader = poptorch.DataLoader(opts, dataset(processes * R), batch_size=B, shuffle=False)
    torch.manual_seed(0)
    model = Net()
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    wrapper = poptorch.trainingModel(model, opts, optimizer=optimizer)
    losses = [wrapper(x, labels)[1].as_subclass(torch.Tensor) for x, labels in loader]
    moments = {k: v["exp_avg"] for k, v in optimizer.state_dict()["state"].items()}
    wrapper.destroy()
    torch.save({"losses": losses, "state": model.state_dict(), "moments": moments},
               f"{out}/process{process}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
