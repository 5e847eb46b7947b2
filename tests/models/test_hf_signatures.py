"""A HuggingFace GPT-2 split over two devices trains on sequences of several lengths with
Options.inputSignatures("several"): one model and optimiser state, as plain PyTorch."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.testing import assert_close

import pipetorch as poptorch
from hf_cases import VOCAB, gpt2, twin
from parallel.parallel_cases import assert_same_state, cleaned, one_thread_everywhere

pytestmark = [pytest.mark.slow, pytest.mark.transformers]

LENGTHS = (16, 24, 16, 32, 24)
G, B = 4, 2


@pytest.fixture(autouse=True)
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


def token_ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (G * B, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_gpt2_over_lengths_equals_plain_pytorch(request, caplog, tied):
    case = gpt2(2, tied=tied, positions=max(LENGTHS))
    plain = twin(case.model)
    # A large eps: the attention's key bias has a gradient of 0 up to rounding, which Adam
    # would turn into steps of lr * sign(noise) that differ between any two runs.
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01, eps=1e-3)
    opts = poptorch.Options().inputSignatures("several").showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(G)
    model = cleaned(request, poptorch.trainingModel(
        case.model, opts, optimizer=poptorch.optim.AdamW(case.model.parameters(), lr=0.01, eps=1e-3)))
    with caplog.at_level(logging.WARNING, logger="pipetorch.runtime.executor"):
        for call, length in enumerate(LENGTHS):
            ids = token_ids(length, call)
            loss = model(input_ids=ids, labels=ids)["loss"]
            plain_opt.zero_grad()
            for g in range(G):
                part = ids[g * B:(g + 1) * B]
                want = plain(input_ids=part, labels=part).loss
                (want / G).backward()
            plain_opt.step()
            assert_close(loss.as_subclass(torch.Tensor), want.detach(), msg=f"call {call}")
    assert sum("Input signature" in r.getMessage() for r in caplog.records) == 2
    assert len(model._compiled.engine.worker_pids) == 2
    assert_same_state(case.model, plain)
