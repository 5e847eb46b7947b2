"""pipetorch.optim trains exactly like torch.optim (or a hand-written reference for LAMB etc.)."""
import copy

import pytest
import torch

import pipetorch as poptorch
from optim_harness import (
    CASES, TORCH_CASES, batches, make_model, params_of, state_tensors, train, train_rounded,
)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_ten_steps_equal_the_reference(case):
    model = make_model()
    ours, twin, reference = case.build(model)
    data = batches()
    case.assert_equal(train(model, ours, data), train(twin, reference, data))
    case.assert_equal(params_of(model), params_of(twin))


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_max_grad_norm_equals_clip_grad_norm_then_the_reference(case):
    model = make_model()
    data = batches()
    probe = copy.deepcopy(model)
    torch.nn.functional.mse_loss(probe(data[0][0]), data[0][1]).backward()
    assert torch.nn.utils.clip_grad_norm_(probe.parameters(), float("inf")) > 0.05, \
        "the threshold must be low enough to clip"
    ours, twin, reference = case.build(model, max_grad_norm=0.05)
    case.assert_equal(train(model, ours, data), train(twin, reference, data, clip=0.05))
    case.assert_equal(params_of(model), params_of(twin))


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_loss_scaling_is_undone_before_the_update(case):
    model = make_model()
    ours, twin, reference = case.build(model, loss_scaling=1024.0)
    data = batches()
    case.assert_equal(train(model, ours, data, loss_scale=1024.0), train(twin, reference, data))
    case.assert_equal(params_of(model), params_of(twin))


def test_step_leaves_the_users_gradients_untouched():
    model = make_model()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=8.0,
                                   max_grad_norm=1e-3)
    train(model, optimizer, batches(steps=1), loss_scale=8.0)
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    torch.testing.assert_close([p.grad for p in model.parameters()], grads, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_low_precision_model_is_updated_in_float32_with_float32_state(case, dtype):
    # PopTorch keeps float32 state for a .half() model unless asked (pipetorch used to keep
    # the parameter's dtype: float16 moments, float16 math, NaN in BERT by the third step).
    model = make_model(dtype)
    shadow = make_model()  # float32 stand-ins for the reference's update
    ours, reference = case.build(model)[0], case.reference_on(shadow)
    data = batches(dtype)
    losses = train(model, ours, data)
    assert torch.stack(losses).float().isfinite().all()
    twin = make_model(dtype)
    case.assert_equal(losses, train_rounded(twin, reference, shadow, data))
    case.assert_equal(params_of(model), params_of(twin))
    assert all(p.dtype == dtype for p in model.parameters())
    states = state_tensors(ours)
    assert bool(states) == (case.name != "SGD")  # plain SGD keeps no state
    assert all(t.dtype == torch.float32 for t in states.values())
    if case.exact:
        torch.testing.assert_close(states, state_tensors(reference), rtol=0, atol=0)


@pytest.mark.parametrize("case", TORCH_CASES, ids=repr)
def test_float64_model_with_default_state_dtypes_stays_torch_bitwise(case):
    # float32, PopTorch's full precision, does not round a float64 model's state.
    model = make_model(torch.float64)
    ours, twin, reference = case.build(model)
    data = batches(torch.float64)
    case.assert_equal(train(model, ours, data), train(twin, reference, data))
    case.assert_equal(params_of(model), params_of(twin))
    assert all(t.dtype == torch.float64 for t in state_tensors(ours).values())
