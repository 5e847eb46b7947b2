"""Training a model whose class, optimiser and loss are defined in the user's `python -c`
script (its `__main__`): the workers get them by value (parallel.comm.stream), and the weights match
plain PyTorch's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent.parent

# Issue 39: objects of the user's __main__ were pickled by reference, and a worker's __main__ is
# another module: an optimiser class defined in the script could not reach the workers.
SCRIPT = '''
import copy, json
import torch, torch.nn as nn
import pipetorch as poptorch

class MySGD(torch.optim.SGD):
    pass

def loss_of(out, y):
    return torch.nn.functional.mse_loss(out, y)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)
    def forward(self, x, y=None):
        with poptorch.Block("A", ipu_id=0):
            h = torch.tanh(self.a(x))
        with poptorch.Block("B", ipu_id=1):
            out = self.b(h)
            return out if y is None else (out, loss_of(out, y))

torch.manual_seed(0)
model = Net()
plain = copy.deepcopy(model)
opts = poptorch.Options().showCompilationProgressBar(False)
opts.Training.gradientAccumulation(4)
wrapper = poptorch.trainingModel(model, opts, optimizer=MySGD(model.parameters(), lr=0.1))
reference = MySGD(plain.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
for _ in range(3):
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    wrapper(x, y)
    for m in range(4):
        (plain(x[2 * m:2 * m + 2], y[2 * m:2 * m + 2])[1] / 4).backward()
    reference.step()
    reference.zero_grad()
wrapper.copyWeightsToHost()
gap = max((p - q).abs().max().item() for p, q in zip(model.parameters(), plain.parameters()))
moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), Net().parameters()))
workers = len(wrapper._compiled.engine.worker_pids)
wrapper.destroy()
print("RESULT " + json.dumps(dict(gap=gap, workers=workers)))
'''


def test_a_script_defined_model_and_optimiser_train_like_plain_pytorch():
    found = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                           text=True, timeout=300,
                           env=os.environ | {"PYTHONPATH": str(ROOT),
                                             "PIPETORCH_THREADS_PER_DEVICE": "1"})
    lines = [line for line in found.stdout.splitlines() if line.startswith("RESULT ")]
    assert found.returncode == 0 and lines, found.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["workers"] == 2
    assert result["gap"] < 1e-6, result
