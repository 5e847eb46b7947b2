"""Automatic loss scaling in the optimisers' step(): skip on overflow, halve, grow, travel."""
import copy
import pickle

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch
from pipetorch.optim import scaling
from pipetorch.optim.peers import Peers, during


def model_and_optimizer(**kwargs):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.1, **kwargs)
    scaling.enable_automatic_loss_scaling(optimizer, growth_interval=3)
    return model, optimizer


def backward(model, optimizer, x):
    optimizer.zero_grad()
    model(x).pow(2).sum().mul(scaling.loss_scale(optimizer)).backward()


def snapshot(model, optimizer):
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return weights, copy.deepcopy(optimizer.state_dict()["state"])


def test_the_scale_starts_from_loss_scaling_or_2_to_the_15():
    assert scaling.loss_scale(model_and_optimizer()[1]) == 2.0 ** 15
    assert scaling.loss_scale(model_and_optimizer(loss_scaling=1000)[1]) == 1000
    static = poptorch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1, loss_scaling=64)
    assert scaling.loss_scale(static) == 64 and not scaling.is_automatic(static)
    assert scaling.scaling_state(static) == {} and scaling.skipped_steps(static) == 0
    assert scaling.loss_scale(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)) == 1.0


def test_an_overflow_skips_the_step_and_halves_the_scale():
    model, optimizer = model_and_optimizer(loss_scaling=256)
    x = torch.randn(4, 3)
    backward(model, optimizer, x)
    optimizer.step()
    weights, state = snapshot(model, optimizer)
    backward(model, optimizer, x)
    model.weight.grad[0, 0] = float("inf")
    optimizer.step()
    for name, param in model.named_parameters():
        assert torch.equal(param, weights[name]), name
        assert param.grad is None  # dropped: a later accumulation starts clean
    assert_close(optimizer.state_dict()["state"], state, rtol=0, atol=0)
    assert scaling.scaling_state(optimizer) == {"scale": 128.0, "growth_interval": 3,
                                                "clean_steps": 0, "skipped_steps": 1,
                                                "used": 256.0}  # the skipped step's scale


def test_a_clean_step_equals_torch_on_the_unscaled_gradients():
    model, optimizer = model_and_optimizer(loss_scaling=512)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.1)
    for seed in range(2):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
        backward(model, optimizer, x)
        optimizer.step()
        ref_opt.zero_grad()
        reference(x).pow(2).sum().backward()
        ref_opt.step()
    for name, param in reference.named_parameters():
        assert_close(model.get_parameter(name), param, msg=name)
    assert scaling.scaling_state(optimizer)["clean_steps"] == 2


def test_the_scale_doubles_after_a_clean_run_within_bounds():
    model, optimizer = model_and_optimizer(loss_scaling=4)
    x = torch.randn(4, 3)
    scales = []
    for _ in range(7):
        backward(model, optimizer, x)
        optimizer.step()
        scales.append(scaling.loss_scale(optimizer))
    assert scales == [4, 4, 8, 8, 8, 16, 16]
    scaling.load_scaling_state(optimizer, {"scale": 2.0 ** 24, "growth_interval": 1,
                                           "clean_steps": 0, "skipped_steps": 0})
    backward(model, optimizer, x)
    optimizer.step()
    assert scaling.loss_scale(optimizer) == 2.0 ** 24  # capped
    scaling.load_scaling_state(optimizer, {"scale": 1.0, "growth_interval": 5,
                                           "clean_steps": 4, "skipped_steps": 0})
    model.weight.grad = torch.full_like(model.weight, float("nan"))
    optimizer.step()
    assert scaling.scaling_state(optimizer) == {"scale": 1.0, "growth_interval": 5,
                                                "clean_steps": 0, "skipped_steps": 1,
                                                "used": 1.0}


def test_another_stages_overflow_skips_a_clean_optimiser_too():
    model, optimizer = model_and_optimizer(loss_scaling=64)
    seen = []

    def reduce(count):  # as a stage worker's sum over stages and replicas: one overflow more
        seen.append(count.clone())
        return count + 1

    backward(model, optimizer, torch.randn(4, 3))
    weights, _ = snapshot(model, optimizer)
    attributes = set(vars(optimizer))
    with during(Peers(reduce)):
        optimizer.step()
    assert set(vars(optimizer)) == attributes  # the worker's sum is not left on the optimiser
    assert len(seen) == 1 and seen[0].dtype == torch.float32 and seen[0].item() == 0
    for name, param in model.named_parameters():
        assert torch.equal(param, weights[name]), name
    assert scaling.skipped_steps(optimizer) == 1 and scaling.loss_scale(optimizer) == 32
    backward(model, optimizer, torch.randn(4, 3))
    with during(Peers(lambda count: count)):  # every stage clean
        optimizer.step()
    assert not torch.equal(model.weight, weights["weight"])
    assert scaling.skipped_steps(optimizer) == 1


def test_the_dynamic_state_travels_with_pickles_and_copies():
    model, optimizer = model_and_optimizer(loss_scaling=8)
    model.weight.grad = torch.full_like(model.weight, float("inf"))
    optimizer.step()
    clone = pickle.loads(pickle.dumps(optimizer))
    assert scaling.scaling_state(clone) == scaling.scaling_state(optimizer)
    copied = copy.deepcopy(optimizer)
    scaling.load_scaling_state(copied, {**scaling.scaling_state(copied), "scale": 2.0})
    assert scaling.loss_scale(optimizer) == 4 and scaling.loss_scale(copied) == 2
    scaling.load_scaling_state(copied, {})
    assert not scaling.is_automatic(copied) and scaling.loss_scale(copied) == 8


def test_enabling_keeps_the_current_state_and_checks_its_arguments():
    model, optimizer = model_and_optimizer(loss_scaling=8)
    model.weight.grad = torch.full_like(model.weight, float("inf"))
    optimizer.step()
    scaling.enable_automatic_loss_scaling(optimizer)
    assert scaling.scaling_state(optimizer)["scale"] == 4
    scaling.enable_automatic_loss_scaling(optimizer, initial_scale=1024, growth_interval=10)
    assert scaling.scaling_state(optimizer) == {"scale": 1024.0, "growth_interval": 10,
                                                "clean_steps": 0, "skipped_steps": 1,
                                                "used": 8.0}  # the step before, at scale 8
    with pytest.raises(ValueError, match=r"growth_interval must be >= 1, got 0"):
        scaling.enable_automatic_loss_scaling(optimizer, growth_interval=0)
    with pytest.raises(ValueError, match=r"initial_scale must be <= 2\*\*24"):
        scaling.enable_automatic_loss_scaling(optimizer, initial_scale=2.0 ** 30)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"needs a pipetorch optimiser.*torch.optim.sgd.SGD.*"
                                        r"poptorch.optim.SGD"):
        scaling.enable_automatic_loss_scaling(plain)
