"""A torchrun job whose processes run ONE pipeline together (stagesAcrossProcesses).

    torchrun --nnodes 2 --node-rank N --nproc-per-node 1 --master-addr 127.0.0.1 \\
        --master-port PORT tests/parallel/torchrun_pipeline_job.py OUT_DIR MODE[,MODE...]

MODE: "train" (1 replica), "replicas" (2 replicas), or a fault process 1 causes before the
second call: "kill" (its worker killed), "stop" (its worker stops answering), "absent" (it
joins only after the others gave up). The modes run one after another in the same processes,
each with a wrapper of its own; each process saves what it saw, {mode: result}, in OUT_DIR.
"""
import os
import signal
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import pipetorch as poptorch

D, G, B, CALLS = 2, 4, 2, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = poptorch.BeginBlock(nn.Linear(8, 3), ipu_id=1)

    def forward(self, x, labels):
        out = self.b(torch.tanh(self.a(x)))
        return out, F.cross_entropy(out, labels)


def dataset(replicas: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = CALLS * D * G * B * replicas
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def fault(mode: str, process: int, wrapper) -> None:
    """Process 1's fault, before the second call."""
    pids = wrapper._compiled.engine.worker_pids
    if process == 1 and mode == "kill":
        os.kill(pids[0], signal.SIGKILL)
    elif process == 1 and mode == "stop":
        os.kill(pids[0], signal.SIGSTOP)


def main(out: str, modes: str) -> None:
    results = {mode: run(mode) for mode in modes.split(",")}
    torch.save(results, f"{out}/process{int(os.environ['RANK'])}.pt")


def run(mode: str) -> dict:
    """One mode's wrapper and calls: what this process saw."""
    replicas = 2 if mode == "replicas" else 1
    opts = poptorch.Options().deviceIterations(D).replicationFactor(replicas)
    opts.showCompilationProgressBar(False).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(G)
    opts.Distributed.stagesAcrossProcesses(True)
    process = opts.Distributed.processId
    loader = poptorch.DataLoader(opts, dataset(replicas), batch_size=B, shuffle=False)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    result = {"losses": [], "states": [], "pids": []}
    start = time.monotonic()
    try:
        if mode == "absent" and process == 1:
            time.sleep(float(os.environ["PIPETORCH_TIMEOUT"]) + 5)
            start = time.monotonic()
        wrapper = poptorch.trainingModel(model, opts, optimizer=optimizer)
        for n, (x, labels) in enumerate(loader):
            if n == 1:
                fault(mode, process, wrapper)
            start = time.monotonic()
            result["losses"].append(wrapper(x, labels)[1].as_subclass(torch.Tensor))
            result["pids"] = wrapper._compiled.engine.worker_pids
            wrapper.copyWeightsToHost()  # the whole model, read on every process
            result["states"].append({k: v.clone() for k, v in model.state_dict().items()})
        wrapper.destroy()
    except Exception as exc:  # the fault modes: what each process raised, and when
        result |= {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return result


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
