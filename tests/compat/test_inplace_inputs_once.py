"""forward's in-place changes to its inputs reach the caller once per call, as in PopTorch
(the compile-time run of forward must leave the caller's tensors alone)."""
import torch
import torch.nn as nn

import pipetorch as poptorch


class _AddOneInPlace(nn.Module):
    def forward(self, x):
        x += 1


def test_first_call_changes_the_input_once():
    # Story: the first call's capture ran forward on the caller's tensor, then the call ran it
    # again: `x += 1` left 3.0 where PopTorch (and eager) leave 2.0.
    model = poptorch.inferenceModel(_AddOneInPlace())
    x = torch.tensor([1.0])
    assert model(x) is None
    assert x.item() == 2.0
    model(x)
    assert x.item() == 3.0


def test_compile_leaves_the_input_alone():
    model = poptorch.inferenceModel(_AddOneInPlace())
    x = torch.tensor([1.0])
    model.compile(x)
    assert x.item() == 1.0
