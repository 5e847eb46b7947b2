"""Issue 22, weights: PopTorch's lazy host copies, counted as PopTorch's own tests count them
(a `deviceToHostCounter` around the wrapper's `copyWeightsToHost`), with the numbers of a
plain PyTorch loop."""
import copy
import types

import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch


class WithLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.loss = model, nn.MSELoss()

    def forward(self, x, target):
        out = self.model(x)
        return out, self.loss(out, target)


def counted(wrapper):
    """PopTorch's idiom: count the wrapper's device-to-host copies by replacing its method."""
    wrapper.deviceToHostCounter = 0
    real = wrapper.copyWeightsToHost

    def device_to_host(self):
        self.deviceToHostCounter += 1
        real()

    wrapper.copyWeightsToHost = types.MethodType(device_to_host, wrapper)
    return wrapper


def plain_steps(model, optimizer, x, target, steps):
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), target).backward()
        optimizer.step()


def test_the_host_copy_happens_once_when_the_host_reads_trained_weights():
    torch.manual_seed(42)
    model = nn.Linear(10, 10)
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    training = counted(poptorch.trainingModel(
        WithLoss(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.01)))
    x, target = torch.randn(1, 10), torch.randn(1, 10)
    for _ in range(5):
        training(x, target)
    plain_steps(plain, plain_opt, x, target, 5)
    assert training.deviceToHostCounter == 0, "training needs no copy to the host"

    out = model(x)  # running the host model reads the trained weights: one copy
    assert training.deviceToHostCounter == 1
    assert_close(out, plain(x))
    training.deviceToHostCounter = 0
    model(x)
    str(list(model.parameters()))
    assert training.deviceToHostCounter == 0, "weights already on the host: no copy"

    for read in (lambda: model.weight.data, lambda: model.state_dict(),
                 lambda: list(model.parameters())):
        training(x, target)
        plain_steps(plain, plain_opt, x, target, 1)
        assert training.deviceToHostCounter == 0
        read()
        assert training.deviceToHostCounter == 1, "one copy when the host reads trained weights"
        training.deviceToHostCounter = 0
    assert_close(model.weight, plain.weight)
    assert_close(model.bias, plain.bias)


def test_an_inference_model_sharing_the_weights_copies_once_per_training_round():
    torch.manual_seed(42)
    model = nn.Linear(10, 10)
    training = counted(poptorch.trainingModel(
        WithLoss(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.01)))
    inference = poptorch.inferenceModel(model)
    x, target = torch.randn(1, 10), torch.randn(1, 10)
    for _ in range(2):
        for _ in range(3):
            out, _ = training(x, target)
        assert training.deviceToHostCounter == 0
        got = inference(x)
        assert training.deviceToHostCounter == 1
        training.deviceToHostCounter = 0
        assert_close(inference(x), got)
        assert training.deviceToHostCounter == 0, "no copy while the weights are unchanged"
    # the inference model sees the weights the training model's last call left
    training(x, target)
    assert_close(inference(x), model(x))
