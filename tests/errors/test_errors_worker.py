"""A failure inside a stage worker names the stage, device and micro-batch, the line of the
user's model the failing operation came from (not the stage's generated code) and the fix."""
from __future__ import annotations

import re

import pytest
import torch

import pipetorch as poptorch
from error_cases import TwoStageClassifier
from pipetorch.errors import DeviceError

pytestmark = pytest.mark.slow


# Issue 23: a label out of range in a split model showed torch's text and a traceback ending in
# "<eval_with_key>.0", line 8 -- the stage's generated code, not the user's.
def test_a_label_out_of_range_in_a_worker_names_the_users_line_and_the_fix():
    wrapper = poptorch.inferenceModel(
        TwoStageClassifier(), poptorch.Options().deviceIterations(2).showCompilationProgressBar(False))
    try:
        x, labels = torch.ones(4, 4), torch.tensor([0, 1, 2, 9])  # micro-batch 1 is wrong
        with pytest.raises(DeviceError) as info:
            wrapper(x, labels)
        head = str(info.value).split("\n\nWorker traceback:\n", 1)[0]
        lines = head.splitlines()
        assert re.fullmatch(
            r"Stage 1 on cpu \(pid \d+\) failed in the forward of micro-batch 1 \(device "
            r"iteration 1, accumulation step 0, replica 0\): IndexError: Target 9 is out of "
            r"bounds\.", lines[0]), lines[0]
        assert re.fullmatch(r"  at \S*tests/errors/error_cases\.py:\d+ in forward: "
                            r"return out, self\.loss\(out, labels\)", lines[1]), lines[1]
        assert lines[2] == (
            "  Class labels (targets) must be in [0, C) for a model with C outputs: check the "
            "dataset's labels against the model's output size (the failing samples are in the "
            "micro-batch named above)")
    finally:
        wrapper.destroy()
