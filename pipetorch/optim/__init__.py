"""PopTorch's optimisers: torch's numbers plus loss scaling, clipping and state dtypes."""
from __future__ import annotations

from pipetorch.optim._common import PopTorchOptimizer as Optimizer
from pipetorch.optim.adam import Adam, AdamW, AdamWNoBias
from pipetorch.optim.attributes import VariableAttributes
from pipetorch.optim.lamb import LAMB, LAMBNoBias
from pipetorch.optim.rmsprop import RMSprop
from pipetorch.optim.sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "AdamWNoBias", "RMSprop", "LAMB", "LAMBNoBias",
           "VariableAttributes"]
