"""torch APIs that PopTorch-era scripts call and newer torch removed, given back as they were.

PopTorch 3.x ran on torch 2.0, whose `Sampler.__init__(self, data_source)` took a data source
and ignored it; torch has since removed that `__init__`, so a script's sampler calling
`super().__init__(dataset)` (as PopTorch's own data loader tests do) raises TypeError before
any data is read. `restore()` puts back an `__init__` that takes and ignores it.
"""
from __future__ import annotations

from collections.abc import Sized

import torch.utils.data as torch_data

__all__: list[str] = []


def _ignoring_data_source(self: torch_data.Sampler[object], data_source: Sized | None = None
                          ) -> None:
    """torch 2.0's `Sampler.__init__`: the data source is not used."""


def restore() -> None:
    """Give `torch.utils.data.Sampler` back its `__init__(data_source=None)` where torch
    dropped it (a no-op on a torch that has one)."""
    if "__init__" not in vars(torch_data.Sampler):
        torch_data.Sampler.__init__ = _ignoring_data_source  # type: ignore[method-assign,assignment]  # torch dropped it
