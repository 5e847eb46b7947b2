"""A stage's weights and optimiser state: read in a worker, and kept on disk after each call.

After every call that changes weights (a training call, copyWeightsToDevice) each stage of
replica 0 writes its state to a file named for the call's parity. If a worker dies in call
c + 1, the files of parity c still hold every stage's state after call c, so the user's model
keeps the weights of the last completed call. Writes go to a temporary name first and are
renamed into place, so a worker killed mid-write never leaves a torn file behind.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

from pipetorch.optim import offload, scaling

__all__: list[str] = []

StageState = tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, Any]]
"""(parameters and buffers by name, optimiser state by parameter name, optimiser-wide state:
{"scaling": automatic loss scaling's state})."""


def stage_state(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> StageState:
    """Copies, on the CPU, of everything of the stage that training changes."""
    state = {n: t.detach().to("cpu", copy=True) for n, t in
             [*module.named_parameters(), *module.named_buffers()]}
    optimizer_state: dict[str, dict[str, Any]] = {}
    attributes: dict[str, Any] = {}
    if optimizer is not None:
        for name, param in module.named_parameters():
            if param in optimizer.state:
                optimizer_state[name] = {
                    k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                    for k, v in optimizer.state[param].items()}
        attributes = {"scaling": scaling.scaling_state(optimizer)}
    return state, optimizer_state, attributes


@torch.no_grad()
def load_stage_state(module: nn.Module, optimizer: torch.optim.Optimizer | None,
                     stage: StageState) -> None:
    """Put `stage` into `module` (in place, any device) and `optimizer`."""
    state, optimizer_state, attributes = stage
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        tensor.copy_(state[name])
    if optimizer is not None:
        params = dict(module.named_parameters())
        home = offload.is_offloaded(optimizer)  # offloaded state stays in host memory
        for name, values in optimizer_state.items():
            device = torch.device("cpu") if home else params[name].device
            optimizer.state[params[name]] = {
                k: v.to(device) if isinstance(v, torch.Tensor) and v.dim() else v
                for k, v in values.items()}
        if "scaling" in attributes:
            scaling.load_scaling_state(optimizer, attributes["scaling"])


def path(folder: str, stage: int, commit: int) -> str:
    return os.path.join(folder, f"stage{stage}-{commit % 2}.pt")


def write(folder: str, stage: int, commit: int, state: StageState) -> None:
    target = path(folder, stage, commit)
    temporary = f"{target}.{os.getpid()}.tmp"
    torch.save((commit, state), temporary)
    os.replace(temporary, target)


def read(folder: str, stage: int, commit: int) -> StageState | None:
    """The state written after call `commit`, or None when there is no such file."""
    try:
        found, state = torch.load(path(folder, stage, commit), weights_only=False)
    except (OSError, EOFError, RuntimeError):
        return None
    return state if found == commit else None
