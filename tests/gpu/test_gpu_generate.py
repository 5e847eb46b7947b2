"""generate() through 2 stages sharing one GPU (2 workers, hops through host memory) gives
plain HuggingFace's tokens on that GPU: the KV caches live on the GPU, in the workers."""
import pytest
import torch

import pipetorch as poptorch
from gpu_cases import CUDA, on_gpu
from models.test_hf_generate import gpt2, prompts

pytestmark = [pytest.mark.slow, pytest.mark.transformers, *CUDA]


def test_gpt2_generates_in_stages_on_the_gpu_like_plain_hf(request, monkeypatch):
    on_gpu(monkeypatch, gpus=1)
    monkeypatch.setenv("PIPETORCH_EXECUTION", "processes")
    torch.manual_seed(0)
    model = gpt2().eval()
    plain = gpt2().eval()
    plain.load_state_dict(model.state_dict())
    plain.cuda()
    inputs = prompts()
    want = plain.generate(**{k: v.cuda() for k, v in inputs.items()}, max_new_tokens=16,
                          pad_token_id=0, do_sample=False)
    opts = poptorch.Options().deviceIterations(2).showCompilationProgressBar(False)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu))
    wrapper = poptorch.inferenceModel(model, opts)
    request.addfinalizer(wrapper.destroy)
    got = wrapper.generate(**inputs, max_new_tokens=16, pad_token_id=0, do_sample=False)
    assert torch.equal(got.cpu(), want.cpu())
    assert len(wrapper._compiled.engine.worker_pids) == 2
