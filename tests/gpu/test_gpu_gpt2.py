"""A small random GPT-2 pipelined over 2 logical devices sharing one GPU (2 workers, gloo
through host memory) trains like plain PyTorch on that GPU: scripts/gpu-check.sh --quick."""
import pytest
import torch

import pipetorch as poptorch
from gpu_cases import CUDA, GPU_TOLERANCE, assert_same_weights, on_gpu
from models.hf_cases import gpt2, plain_call, twin

pytestmark = [pytest.mark.slow, pytest.mark.transformers, *CUDA]

D, B, G = 2, 2, 3


def test_gpt2_over_two_devices_sharing_the_gpu_trains_like_plain_pytorch(request, monkeypatch):
    on_gpu(monkeypatch, gpus=1)
    monkeypatch.setenv("PIPETORCH_EXECUTION", "processes")
    case = gpt2(2)
    plain = twin(case.model).cuda()
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    opts = poptorch.Options().deviceIterations(D).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(G)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu))
    opts.showCompilationProgressBar(False)
    model = case.model
    wrapper = poptorch.trainingModel(
        model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    request.addfinalizer(wrapper.destroy)
    for seed in range(2):
        inputs = case.make_inputs(D * G * B, seed)
        got = wrapper(**inputs)
        want = plain_call(plain, plain_optimizer, {k: v.cuda() for k, v in inputs.items()},
                          D=D, G=G, B=B)
        torch.testing.assert_close(got["loss"].cpu(), want["loss"].cpu(), **GPU_TOLERANCE)
    engine = wrapper._compiled.engine
    assert len(engine.worker_pids) == 2
    assert {t.transport for t in engine.last_trace} == {"gloo"}  # NCCL refuses a shared GPU
    wrapper.copyWeightsToHost()
    assert_same_weights(model, plain, **GPU_TOLERANCE)
