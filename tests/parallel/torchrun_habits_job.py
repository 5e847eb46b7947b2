"""A torchrun job of one pipeline over two processes, run with data-parallel habits.

    torchrun --nnodes 2 --node-rank N --nproc-per-node 1 --master-addr 127.0.0.1 \\
        --master-port PORT tests/parallel/torchrun_habits_job.py OUT_DIR MODE[,MODE...]

The modes run one after another in the same two processes, each with a wrapper of its own
(one launch serves several tests). MODE:
- "seeded" / "seeded-async": each process seeds torch with 100 + its rank before it builds
  the model and a shuffling DataLoader (no randomSeed; Sync or Async mode); it records the
  batches it fed and its initial weights.
- "mismatch": process 1 feeds inputs of its own in the second call.
- "rank0-read": process 0 alone reads the weights (state_dict, torch.save) after each call.
- "out-of-step": process 0 alone calls setOptimizer before the second call.
- "kill0" / "kill1": that process kills itself (SIGKILL) before the second call.
Each surviving process saves what it saw in each mode, {mode: result}, in OUT_DIR.
"""
import io
import os
import signal
import sys
import time
from typing import Callable

import torch

import pipetorch as poptorch
from torchrun_pipeline_job import D, G, B, Net, dataset


def main(out: str, modes: str) -> None:
    process = int(os.environ["RANK"])
    results: dict[str, dict] = {}

    def save() -> None:
        torch.save(results, f"{out}/process{process}.pt")
    for mode in modes.split(","):
        run(mode, process, results, save)
    save()


def run(mode: str, process: int, results: dict[str, dict], save: Callable[[], None]) -> None:
    """One mode's wrapper and calls: what this process saw, as results[mode] (`save` writes
    `results`, before a "kill" mode ends the process)."""
    seeded = mode.startswith("seeded")
    torch.manual_seed(100 + process if seeded else 0)
    opts = poptorch.Options().deviceIterations(D).outputMode(poptorch.OutputMode.All)
    opts.showCompilationProgressBar(False).Training.gradientAccumulation(G)
    opts.Distributed.stagesAcrossProcesses(True)
    kind = poptorch.DataLoaderMode.Async if mode == "seeded-async" else None
    loader = poptorch.DataLoader(opts, dataset(1), batch_size=B, shuffle=seeded,
                                 **({"mode": kind} if kind else {}))
    model = Net()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrapper = poptorch.trainingModel(model, opts, optimizer=optimizer)
    result = results[mode] = {"initial": initial, "batches": [], "losses": [], "states": [],
                              "pids": []}
    start = time.monotonic()
    try:
        for n, (x, labels) in enumerate(loader):
            if n == 1 and mode == "kill" + str(process):
                save()
                os.kill(os.getpid(), signal.SIGKILL)
            if n == 1 and mode == "out-of-step" and process == 0:
                wrapper.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
            if n == 1 and mode == "mismatch" and process == 1:
                x = x + 1
            start = time.monotonic()
            result["batches"].append((x.clone(), labels.clone()))  # the loader reuses its memory
            result["losses"].append(wrapper(x, labels)[1].as_subclass(torch.Tensor))
            result["pids"] = wrapper._compiled.engine.worker_pids
            if mode != "rank0-read" or process == 0:
                torch.save(wrapper.state_dict(), io.BytesIO())  # the rank-0 habit
                result["states"].append({k: v.clone() for k, v in model.state_dict().items()})
    except Exception as exc:
        result |= {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start,
                   "calls": len(result["losses"])}
    finally:
        wrapper.destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
