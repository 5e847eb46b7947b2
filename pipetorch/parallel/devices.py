"""Which torch device the single-process runtime computes on."""
from __future__ import annotations

import torch

from pipetorch import environment

__all__: list[str] = []


def default_device() -> torch.device:
    """`$PIPETORCH_DEVICE` ("cpu", "cuda", "cuda:1"), else the first GPU, else the CPU."""
    chosen = environment.get("device")
    return chosen or torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rng_state(device: torch.device) -> list[torch.Tensor]:
    """The random generators `device`'s work draws from: the CPU's, then the GPU's if any."""
    states = [torch.random.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def set_rng_state(states: list[torch.Tensor], device: torch.device) -> None:
    """Restore what `rng_state(device)` returned."""
    expected = 2 if device.type == "cuda" else 1
    if not isinstance(states, (list, tuple)) or len(states) != expected:
        raise ValueError(f"A random state for {device} is a list of {expected} uint8 tensors "
                         f"(as rng_state returns), got {states!r:.80}")
    torch.random.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
