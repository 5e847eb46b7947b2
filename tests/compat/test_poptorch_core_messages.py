"""PopTorch's own wording for pipelined batch-count errors, raised as
`poptorch.poptorch_core.Error` (PopTorch's C++ core's error class) with the values and fix."""
import pytest
import torch
import torch.nn as nn

import pipetorch as poptorch


class Four(nn.Module):
    """Four one-weight blocks on four devices."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(1, 1) for _ in range(4))

    def forward(self, x):
        for i, lin in enumerate(self.lins):
            with poptorch.Block(f"B{i}", ipu_id=i):
                x = lin(x)
        return x


class FourWithLoss(Four):
    def forward(self, x):
        out = super().forward(x)
        with poptorch.Block("B3", ipu_id=3):
            return out, poptorch.identity_loss(out, reduction="mean")


def test_core_error_is_the_pipetorch_error():
    assert poptorch.poptorch_core.Error is poptorch.Error
    assert issubclass(poptorch.poptorch_core.RecoverableError, poptorch.Error)


@pytest.mark.parametrize("sharded", [False, True])
def test_inference_refuses_gradient_accumulation(sharded):
    opts = poptorch.Options()
    if sharded:
        opts.setExecutionStrategy(poptorch.ShardedExecution())
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.poptorch_core.Error) as info:
        poptorch.inferenceModel(Four(), options=opts)
    message = str(info.value)
    assert ("gradientAccumulation to 1 or leave it as its default value (1) when running a "
            "poptorch.inferenceModel().") in message and "It is 2" in message
    assert ("Use poptorch.Options().deviceIterations to process" in message) is not sharded


def test_pipelined_training_names_the_stages_as_poptorch_does():
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(5)
    model = poptorch.trainingModel(FourWithLoss(), options=opts)
    with pytest.raises(poptorch.poptorch_core.Error,
                       match=r"number of pipeline stages \(7\) when using "
                       r"poptorch\.PipelinedExecution\. Please note that a model with 4 pipeline "
                       r"stages in PopTorch will have an additional 3 stages when training\."
                       r".*gradientAccumulation \(5\) must be >= 2\*stages-1 \(7\)"):
        model(torch.zeros(5))


def test_pipelined_inference_names_device_iterations_as_poptorch_does():
    opts = poptorch.Options().deviceIterations(2)
    model = poptorch.inferenceModel(Four(), options=opts)
    with pytest.raises(poptorch.poptorch_core.Error,
                       match=r"poptorch\.Options\(\)\.deviceIterations must be greater than or "
                       r"equal to the number of pipeline stages \(4\).*deviceIterations \(2\)"):
        model(torch.zeros(2))


def test_is_compiling_with_dispatcher_only_while_a_model_is_captured():
    # PopTorch's test_missing_block checks that a failed compile leaves the dispatcher
    # inactive; poptorch_core had no isCompilingWithDispatcher.
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(poptorch.poptorch_core.isCompilingWithDispatcher())
            poptorch.Block.useAutoId()
            with poptorch.Block(ipu_id=0):
                x = x * 4
            return x * 4 if self.after_block else x

    model = Probe()
    model.after_block = True  # work outside any block: compiling fails
    opts = poptorch.Options().deviceIterations(2)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    with pytest.raises(poptorch.Error, match="No active Block"):
        poptorch.inferenceModel(model, opts).compile(torch.randn(2, 5))
    assert True in seen and not poptorch.poptorch_core.isCompilingWithDispatcher()
    model.after_block, seen[:] = False, []
    wrapped = poptorch.inferenceModel(model, opts)
    x = torch.randn(2, 5)
    torch.testing.assert_close(wrapped(x), x * 4)
    assert True in seen and not poptorch.poptorch_core.isCompilingWithDispatcher()
