"""anchorTensor takes PopTorch's spelling of tensor names, where the user's model is `model`
("Gradient___model.fc2.bias", as PopTorch's user guide and Graphcore's examples write them)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import pipetorch as poptorch


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, F.mse_loss(out, y)


def _trained(**anchors: str) -> poptorch.PoplarExecutor:
    torch.manual_seed(0)
    opts = poptorch.Options()
    for short, long in anchors.items():
        opts.anchorTensor(short, long)
    wrapped = poptorch.trainingModel(_Model(), opts)
    wrapped(torch.randn(2, 4), torch.randn(2, 4))
    return wrapped


def test_poptorch_spelling_reads_the_same_tensors():
    # Story: only "Gradient___fc2.bias" was known; PopTorch scripts' "Gradient___model.fc2.bias"
    # was refused at compile.
    ours = _trained(g="Gradient___fc2.bias", w="UpdatedVar___fc1.weight")
    theirs = _trained(g="Gradient___model.fc2.bias", w="UpdatedVar___model.fc1.weight")
    for short in ("g", "w"):
        torch.testing.assert_close(theirs.getAnchoredTensor(short), ours.getAnchoredTensor(short))


def test_tensor_names_list_both_spellings():
    names = _trained().getTensorNames()
    assert {"Gradient___fc2.bias", "Gradient___model.fc2.bias", "model.fc1.weight",
            "loss"} <= set(names)
    assert "model.loss" not in names
