"""Ctrl-C during a call of a model split over worker processes discards that call; the
wrapper goes on with new workers from the state after the last completed call."""
from __future__ import annotations

import copy

import pytest
import torch

import pipetorch as poptorch
from error_cases import TwoStageClassifier, descendants
from helpers.reference import plain_train_call
from pipetorch.parallel.comm import wire

pytestmark = pytest.mark.slow

D, G = 1, 3  # two pipelined stages need G >= 3


def batch(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(D * G * 2, 4, generator=gen), torch.randint(0, 3, (D * G * 2,), generator=gen)


def interrupt_the_next_wait(monkeypatch):
    """Ctrl-C while the host waits for the workers (where a call spends its time): the
    workers got their inputs and compute."""
    real = wire.gather

    def gather(*args, what, **kwargs):
        if what == "a training call":
            monkeypatch.setattr(wire, "gather", real)
            raise KeyboardInterrupt
        return real(*args, what=what, **kwargs)

    monkeypatch.setattr(wire, "gather", gather)


# Issue 23: after Ctrl-C a wrapper could never run again ("call destroy() and build a new
# trainingModel"); PopTorch users interrupt a call and go on.
def test_after_ctrl_c_the_wrapper_goes_on_from_the_last_completed_call(monkeypatch):
    torch.manual_seed(0)
    model = TwoStageClassifier()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opts = poptorch.Options().deviceIterations(D).showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(G)
    wrapper = poptorch.trainingModel(model, opts,
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        wrapper(*batch(1))
        plain_train_call(reference, ref_opt, *batch(1), D=D, G=G, R=1)
        old = set(wrapper._compiled.engine.worker_pids)
        interrupt_the_next_wait(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            wrapper(*batch(2))  # discarded: the reference never sees it
        assert not old & descendants(), "the interrupted call's workers still run"

        _, loss = wrapper(*batch(3))
        rows = plain_train_call(reference, ref_opt, *batch(3), D=D, G=G, R=1)
        assert not old & set(wrapper._compiled.engine.worker_pids)  # new workers
        torch.testing.assert_close(loss, rows[-1][3])
        for name, param in reference.named_parameters():
            torch.testing.assert_close(model.get_parameter(name), param, msg=name)
    finally:
        wrapper.destroy()
