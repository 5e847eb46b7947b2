"""A torchrun job whose processes run one pipeline of a mapped model (stagesAcrossProcesses)
and save it: each process writes its own stage's file into OUT_DIR/trained.

    torchrun --nnodes 2 --node-rank N --nproc-per-node 1 --master-addr 127.0.0.1 \\
        --master-port PORT tests/parallel/torchrun_saving_job.py OUT_DIR WIDTH WHERE

WHERE: "shared" (both processes save into OUT_DIR/trained, as on one machine) or "apart"
(process p into OUT_DIR/machine{p}/trained, as on machines of their own).

Trains CALLS calls, copies the weights to the host (the save: peak RSS measured around it),
then maps the saved folder into a new model and trains one more call. Each process saves
what it saw in OUT_DIR/process{p}.pt.
"""
import os
import shutil
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_model

import pipetorch as poptorch
from pipetorch.errors import ConfigError
from pipetorch.parallel.comm import resident
from pipetorch.weights import saving
from torchrun_pipeline_job import B, D, G, dataset


class Back(nn.Module):
    """h @ weight: the input layer's weight read transposed, on the last stage (a tie)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, h):
        return h @ self.weight


class TiedNet(nn.Module):
    """Two stages of two wide layers; `a.weight` is tied with stage 1's `back.weight`."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.a, self.mid0 = nn.Linear(6, width), nn.Linear(width, width)
        self.mid1 = poptorch.BeginBlock(nn.Linear(width, width), ipu_id=1)
        self.back, self.c = Back(self.a.weight), nn.Linear(6, 3)

    def forward(self, x, labels):
        h = torch.tanh(self.mid0(torch.tanh(self.a(x))))
        out = self.c(torch.tanh(self.back(torch.tanh(self.mid1(h)))))
        return out, F.cross_entropy(out, labels)


def optimizer_of(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)  # no state: a reload resumes exactly


def mapped_model(width: int, path: str, **output: str) -> TiedNet:
    with poptorch.empty_weights():
        model = TiedNet(width)
    return poptorch.map_weights(model, path, **output)


def main(out: str, width: int, where: str) -> None:
    opts = poptorch.Options().deviceIterations(D).showCompilationProgressBar(False)
    opts.outputMode(poptorch.OutputMode.All).Training.gradientAccumulation(G)
    opts.Distributed.stagesAcrossProcesses(True)
    process = opts.Distributed.processId
    torch.manual_seed(0)
    source = os.path.join(out, f"init{process}.safetensors")
    save_model(TiedNet(width), source)  # the tied weight once
    folder = os.path.join(out, *([f"machine{process}"] if where == "apart" else []), "trained")
    model = mapped_model(width, source, output=folder)
    opened = []  # the files this process writes
    open_file = saving._Partial.__init__

    def recording(self, path, *args):
        opened.append(os.path.basename(path))
        open_file(self, path, *args)

    saving._Partial.__init__ = recording
    loader = poptorch.DataLoader(opts, dataset(1), batch_size=B, shuffle=False)
    wrapper = poptorch.trainingModel(model, opts, optimizer=optimizer_of(model))
    losses = [wrapper(x, labels)[1].as_subclass(torch.Tensor) for x, labels in loader]
    resident.give_back_freed()
    resident.reset_peak_rss()
    before = resident.rss(os.getpid())
    wrapper.copyWeightsToHost()  # the save
    save_peak = resident.peak_rss() - before
    files = sorted(os.listdir(folder))
    state = {k: v.clone() for k, v in model.state_dict().items()}  # the files, mapped
    wrapper.destroy()
    refused = ""
    if where == "apart":  # the other machine's file is not here: gathered as rsync would
        try:
            mapped_model(width, folder)
        except ConfigError as exc:
            refused = str(exc)
        theirs = os.path.join(out, f"machine{1 - process}", "trained")
        for name in os.listdir(theirs):
            if not os.path.exists(os.path.join(folder, name)):
                shutil.copy(os.path.join(theirs, name), folder)

    again = mapped_model(width, folder)  # resume from the saved folder
    resumed = poptorch.trainingModel(again, opts, optimizer=optimizer_of(again))
    x, labels = next(iter(loader))
    resumed_loss = resumed(x, labels)[1].as_subclass(torch.Tensor)
    resumed.destroy()
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    torch.save({"losses": losses, "opened": opened, "state": state, "resumed": resumed_loss,
                "save_peak": save_peak, "model_bytes": model_bytes, "refused": refused,
                "files": files},
               os.path.join(out, f"process{process}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
