"""Stage workers on GPUs: the numbers of plain PyTorch, and the allocator's peak in the report."""
import json

import pytest
import torch
from torch.testing import assert_close

import pipetorch as poptorch
from parallel_cases import assert_same_state, cleaned, mnist_case, options, twin

pytestmark = [pytest.mark.slow, pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_pipelined_training_on_gpus_reports_each_workers_peak(request, monkeypatch, tmp_path):
    monkeypatch.setenv("PIPETORCH_DEVICE", "cuda")
    case = mnist_case(2)
    plain = twin(case.model)
    opts = options(case, sharded=False, D=2, G=3).enableProfiling(str(tmp_path))
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.05)  # noqa: E731
    wrapper = cleaned(request, poptorch.trainingModel(case.model, opts, optimizer=make(case.model)))
    x, labels = case.data(2 * 3 * 2, seed=0)
    _, loss = wrapper(x, labels)
    plain_optimizer = make(plain)
    losses = []
    for d in range(2):
        plain_optimizer.zero_grad()
        for g in range(3):
            rows = slice((d * 3 + g) * 2, (d * 3 + g + 1) * 2)
            _, step_loss = plain(x[rows], labels[rows])
            (step_loss / 3).backward()
            losses.append(step_loss.detach())
        plain_optimizer.step()
    assert_close(loss, torch.stack(losses), rtol=1e-4, atol=1e-5)
    engine = wrapper._compiled.engine
    assert sorted(engine.peak_memory) == [0, 1] and min(engine.peak_memory.values()) > 0
    wrapper.destroy()
    assert_same_state(case.model, plain)
    report = json.loads((tmp_path / "training" / "memory.json").read_text())
    assert [d["measured_peak"] for d in report["devices"]] == [engine.peak_memory[0],
                                                               engine.peak_memory[1]]
