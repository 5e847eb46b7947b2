"""When workers write their state after a training call (PIPETORCH_SNAPSHOTS)."""
from __future__ import annotations

import copy
import logging
import os
import signal

import pytest
import torch

import pipetorch as poptorch
from fault_cases import registry  # noqa: F401 - the fixture
from fault_cases import TokenNet, options, token_data, wait_gone
from helpers.reference import plain_train_call
from pipetorch.weights import snapshot
from pipetorch.weights.snapshot import RATIO, SMALL, SnapshotPolicy, nbytes


def test_auto_writes_a_small_state_after_every_call():
    policy = SnapshotPolicy("auto")
    assert policy.wanted()  # the first call: nothing written yet
    for _ in range(5):
        policy.called(0.01, (1.0, SMALL))  # a slow disk, but a small state
        assert policy.wanted()


def test_auto_writes_a_large_state_once_it_costs_a_tenth_of_the_training():
    policy = SnapshotPolicy("auto")
    policy.called(2.0, (3.0, 4 << 30))  # 4 GB took 3 s to write
    trained = 0.0
    while not policy.wanted():  # calls of 2 s go by without a write ...
        policy.called(2.0, None)
        trained += 2.0
    assert trained >= RATIO * 3.0 > trained - 2.0  # ... until 27 s of training
    policy.called(2.0, (1.0, 4 << 30))  # a faster write: sooner next time
    policy.called(9.0, None)
    assert policy.wanted()


def test_one_and_zero_are_every_call_and_never():
    always, never = SnapshotPolicy("1"), SnapshotPolicy("0")
    always.called(1.0, (100.0, 8 << 30))
    assert always.wanted() and not never.wanted()


def test_a_state_counts_its_weights_and_optimiser_tensors():
    weights = {"w": torch.zeros(4, 4), "b": torch.zeros(4, dtype=torch.float16)}
    state = {"w": {"exp_avg": torch.zeros(4, 4), "step": 3}}
    assert nbytes((weights, state, {"scaling": {}})) == 64 + 8 + 64


@pytest.mark.slow
def test_a_large_state_returns_the_model_to_the_last_call_written(registry, monkeypatch, caplog):
    # every state counts as large and a write as never paying off: only the first call writes
    monkeypatch.setattr(snapshot, "SMALL", -1)
    monkeypatch.setattr(snapshot, "RATIO", 1e9)
    torch.manual_seed(0)
    model = TokenNet()
    reference = copy.deepcopy(model)
    tokens, labels = token_data(8)
    plain_train_call(reference, _sgd(reference), tokens, labels, D=1, G=4, R=1)
    wrapper = poptorch.trainingModel(model, options(G=4), optimizer=_sgd(model))
    try:
        for _ in range(3):
            wrapper(tokens, labels)
        pids = list(wrapper._compiled.engine.worker_pids)
        os.kill(pids[1], signal.SIGKILL)
        assert wait_gone([pids[1]]) == []
    finally:
        with caplog.at_level(logging.WARNING, logger="pipetorch.parallel.host.engine"):
            wrapper.destroy()
    assert "2 call(s) before the last completed one" in caplog.text
    for name, param in reference.named_parameters():  # the state after the first call
        torch.testing.assert_close(model.get_parameter(name), param, msg=name)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)
