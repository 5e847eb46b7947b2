"""pipetorch.optim's surface: signatures, attributes, validation, and the executor's rebuild."""
import copy
import math

import pytest
import torch

import pipetorch as poptorch
from optim_harness import batches, make_model, params_of, state_tensors, train, two_groups

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

# Every PopTorch extra set away from its default, so the rebuild must carry each one.
REBUILD_CASES = [
    (poptorch.optim.SGD, dict(lr=0.1, momentum=0.9, loss_scaling=4.0, max_grad_norm=10.0,
                              velocity_scaling=2.0, use_combined_accum=True,
                              accum_type=BF16, velocity_accum_type=F16)),
    (poptorch.optim.SGD, dict(lr=0.1, momentum=0.9, accum_type=BF16, velocity_accum_type=F16)),
    (poptorch.optim.Adam, dict(lr=0.01, loss_scaling=4.0, max_grad_norm=10.0, accum_type=BF16,
                               first_order_momentum_accum_type=F16,
                               second_order_momentum_accum_type=F32)),
    (poptorch.optim.AdamW, dict(lr=0.01, loss_scaling=4.0, bias_correction=False,
                                max_grad_norm=10.0, first_order_momentum_accum_type=F16)),
    (poptorch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True, loss_scaling=4.0,
                                  max_grad_norm=10.0, use_tf_variant=True,
                                  second_order_momentum_accum_type=F16)),
    (poptorch.optim.LAMB, dict(lr=0.01, loss_scaling=4.0, bias_correction=False,
                               max_weight_norm=2.0, max_grad_norm=10.0, accum_type=F16,
                               first_order_momentum_accum_type=BF16)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.Adam, dict(lr=0.01)),
]


def hyper_parameters(optimizer):
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


@pytest.mark.parametrize("cls, kwargs", REBUILD_CASES, ids=[
    f"{cls.__module__.split('.')[0]}.{cls.__name__}" for cls, _ in REBUILD_CASES])
def test_executor_rebuild_round_trip_continues_identically(cls, kwargs):
    model = make_model()
    optimizer = cls(two_groups(model, lr=0.05), **kwargs)
    scale = getattr(optimizer, "loss_scaling", 1.0)  # what the executor multiplies the loss by
    data = batches(steps=6)
    train(model, optimizer, data[:3], loss_scale=scale)

    # torch's load_state_dict shares state tensors with the source: continue the original
    # on a deep copy so neither run disturbs the other.
    expected_model, expected_optimizer = copy.deepcopy((model, optimizer))
    # What the executor does with its own copy of the model.
    twin = copy.deepcopy(model)
    rebuilt = type(optimizer)([{"params": list(twin[0].parameters())},
                               {"params": list(twin[2].parameters())}], **optimizer.defaults)
    rebuilt.load_state_dict(optimizer.state_dict())

    assert rebuilt.defaults == optimizer.defaults
    type(rebuilt)(copy.deepcopy(twin).parameters(), **rebuilt.defaults)  # and again, after a load
    assert hyper_parameters(rebuilt) == hyper_parameters(optimizer)
    assert {k: v.dtype for k, v in state_tensors(rebuilt).items()} == \
        {k: v.dtype for k, v in state_tensors(optimizer).items()}
    losses = train(twin, rebuilt, data[3:], loss_scale=scale)
    torch.testing.assert_close(
        losses, train(expected_model, expected_optimizer, data[3:], loss_scale=scale),
        rtol=0, atol=0)
    torch.testing.assert_close(params_of(twin), params_of(expected_model), rtol=0, atol=0)


def test_extras_are_attributes_kept_in_defaults_and_groups():
    # PopTorch reads its accumulation types back as torch.float32 unless set (None too).
    optimizer = poptorch.optim.SGD(make_model().parameters(), lr=0.1, velocity_scaling=None,
                                   accum_type=None)
    assert (optimizer.loss_scaling, optimizer.max_grad_norm, optimizer.velocity_scaling,
            optimizer.use_combined_accum, optimizer.accum_type,
            optimizer.velocity_accum_type) == (1.0, math.inf, 1.0, False, F32, F32)
    optimizer.loss_scaling = 512
    assert optimizer.loss_scaling == 512.0 == optimizer.defaults["loss_scaling"]
    assert all(group["loss_scaling"] == 512.0 for group in optimizer.param_groups)
    assert optimizer.state_dict()["param_groups"][0]["loss_scaling"] == 512.0
    with pytest.raises(ValueError, match="loss_scaling must be a real number > 0"):
        optimizer.loss_scaling = -2.0
    assert optimizer.loss_scaling == 512.0


def test_group_by_group_copy_carries_the_extras():
    # setOptimizer copies hyper-parameters group by group onto the executor's optimiser.
    source = poptorch.optim.LAMB(two_groups(make_model()), lr=0.01)
    target = poptorch.optim.LAMB(two_groups(make_model()), lr=0.01)
    source.loss_scaling = 64.0
    source.param_groups[1]["max_weight_norm"] = 3.0
    for dst, src in zip(target.param_groups, source.param_groups):
        dst.update({k: v for k, v in src.items() if k != "params"})
    assert target.loss_scaling == 64.0
    assert target.param_groups[1]["max_weight_norm"] == 3.0


def test_poptorch_none_means_the_poptorch_default():
    lamb = poptorch.optim.LAMB(make_model().parameters(), max_weight_norm=None,
                               bias_correction=None, loss_scaling=None, max_grad_norm=None)
    assert (lamb.max_weight_norm, lamb.bias_correction, lamb.loss_scaling,
            lamb.max_grad_norm) == (65500.0, True, 1.0, math.inf)
    assert poptorch.optim.RMSprop(make_model().parameters(), use_tf_variant=None).use_tf_variant \
        is False


def test_optimisers_subclass_torchs():
    assert issubclass(poptorch.optim.SGD, torch.optim.SGD)
    assert issubclass(poptorch.optim.Adam, torch.optim.Adam)
    assert issubclass(poptorch.optim.AdamW, torch.optim.AdamW)
    assert issubclass(poptorch.optim.RMSprop, torch.optim.RMSprop)
    assert issubclass(poptorch.optim.LAMB, torch.optim.Optimizer)


@pytest.mark.parametrize("cls", [poptorch.optim.Adam, poptorch.optim.AdamW])
def test_amsgrad_is_refused(cls):
    with pytest.raises(ValueError, match="amsgrad=True is not supported by PopTorch"):
        cls(make_model().parameters(), amsgrad=True)


@pytest.mark.parametrize("cls, kwargs, error, message", [
    (poptorch.optim.SGD, dict(lr=-1), ValueError, r"lr must be .* >= 0.*got -1; pass a value >= 0"),
    (poptorch.optim.SGD, dict(lr="0.1"), TypeError, r"lr must be a real number.*got '0.1'"),
    (poptorch.optim.SGD, dict(momentum=-0.5), ValueError, "momentum .*got -0.5"),
    (poptorch.optim.SGD, dict(dampening=float("nan")), ValueError, "dampening"),
    (poptorch.optim.SGD, dict(weight_decay=-1.0), ValueError, "weight_decay"),
    (poptorch.optim.SGD, dict(nesterov=1), TypeError, "nesterov must be True or False, got 1"),
    (poptorch.optim.SGD, dict(loss_scaling=0), ValueError, "loss_scaling must be .* > 0"),
    (poptorch.optim.SGD, dict(loss_scaling=math.inf), ValueError, r"loss_scaling .*\(finite\)"),
    (poptorch.optim.SGD, dict(loss_scaling=True), TypeError, "loss_scaling .*got True"),
    (poptorch.optim.SGD, dict(max_grad_norm=-1.0), ValueError, "max_grad_norm .*got -1.0"),
    (poptorch.optim.SGD, dict(velocity_scaling=math.nan), ValueError, "velocity_scaling"),
    (poptorch.optim.SGD, dict(use_combined_accum="yes"), TypeError, "use_combined_accum must be"),
    (poptorch.optim.SGD, dict(velocity_accum_type=torch.int8), ValueError,
     r"velocity_accum_type must be torch.float32, torch.float16 or torch.bfloat16 .*int8"),
    (poptorch.optim.SGD, dict(accum_type="float16"), TypeError, "accum_type must be a torch.dtype"),
    (poptorch.optim.SGD, dict(accumType=F16), TypeError, "accumType"),
    (poptorch.optim.Adam, dict(betas=(0.9,)), TypeError,
     r"betas must be a pair.*betas=\(0.9, 0.999\)"),
    (poptorch.optim.Adam, dict(betas=(0.9, 1.0)), ValueError, r"betas\[1\] .*< 1"),
    (poptorch.optim.Adam, dict(eps=-1e-8), ValueError, "eps"),
    (poptorch.optim.Adam, dict(first_order_momentum_accum_type=torch.float64), ValueError,
     "first_order_momentum_accum_type"),
    (poptorch.optim.AdamW, dict(bias_correction=0), TypeError, "bias_correction must be"),
    (poptorch.optim.AdamW, dict(decoupled_weight_decay=False), ValueError,
     "use pipetorch.optim.Adam"),
    (poptorch.optim.RMSprop, dict(alpha=-0.1), ValueError, "alpha"),
    (poptorch.optim.RMSprop, dict(centered=None), TypeError, "centered must be True or False"),
    (poptorch.optim.RMSprop, dict(use_tf_variant="tf"), TypeError, "use_tf_variant must be"),
    (poptorch.optim.LAMB, dict(max_weight_norm=0.0), ValueError, "max_weight_norm .* > 0"),
    (poptorch.optim.LAMB, dict(second_order_momentum_accum_type=torch.int32), ValueError,
     "second_order_momentum_accum_type"),
])
def test_invalid_arguments_name_the_argument_value_and_fix(cls, kwargs, error, message):
    with pytest.raises(error, match=message):
        cls(make_model().parameters(), **kwargs)


def test_invalid_per_group_extra_is_refused():
    groups = two_groups(make_model(), velocity_scaling=-1.0)
    with pytest.raises(ValueError, match="velocity_scaling must be .* > 0.*got -1.0"):
        poptorch.optim.SGD(groups, lr=0.1, momentum=0.9, use_combined_accum=True)


def test_global_extras_must_agree_across_groups():
    model = make_model()
    optimizer = poptorch.optim.Adam(two_groups(model), lr=0.01)
    optimizer.param_groups[1]["loss_scaling"] = 2.0
    with pytest.raises(ValueError, match=r"loss_scaling must be the same in every param group, "
                                         r"got \[1.0, 2.0\]; set it once with optimizer"):
        train(model, optimizer, batches(steps=1))


def test_loads_a_plain_torch_optimisers_state():
    model, twin = make_model(), make_model()
    reference = torch.optim.RMSprop(twin.parameters(), lr=0.01, momentum=0.5)
    train(twin, reference, batches(steps=2))
    model.load_state_dict(twin.state_dict())
    optimizer = poptorch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.5)
    optimizer.load_state_dict(copy.deepcopy(reference.state_dict()))
    assert optimizer.use_tf_variant is False and optimizer.loss_scaling == 1.0
    data = batches(steps=3)
    torch.testing.assert_close(train(model, optimizer, data), train(twin, reference, data),
                               rtol=0, atol=0)


def test_step_with_a_closure_returns_its_loss_and_updates_like_torch():
    model, twin = make_model(), make_model()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01, loss_scaling=2.0)
    reference = torch.optim.Adam(twin.parameters(), lr=0.01)
    x, y = batches(steps=1)[0]

    def closure(net, opt, scale):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        (loss * scale).backward()
        return loss

    ours = optimizer.step(lambda: closure(model, optimizer, 2.0))
    torch.testing.assert_close(ours, reference.step(lambda: closure(twin, reference, 1.0)))
    torch.testing.assert_close(params_of(model), params_of(twin), rtol=0, atol=0)


def test_state_dict_saves_and_loads_with_torch_save(tmp_path):
    model = make_model()
    optimizer = poptorch.optim.LAMB(model.parameters(), first_order_momentum_accum_type=F16)
    train(model, optimizer, batches(steps=2))
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    loaded = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    assert loaded["param_groups"][0]["first_order_momentum_accum_type"] == F16
    torch.testing.assert_close(loaded["state"][0]["exp_avg"], optimizer.state[model[0].weight][
        "exp_avg"], rtol=0, atol=0)


def test_lr_schedulers_drive_it_like_torch():
    model, twin = make_model(), make_model()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
                  for o in (optimizer, reference)]
    for x, y in batches(steps=5):
        for net, opt, scheduler in zip((model, twin), (optimizer, reference), schedulers):
            train(net, opt, [(x, y)])
            scheduler.step()
    assert optimizer.param_groups[0]["lr"] == reference.param_groups[0]["lr"] == 0.025
    torch.testing.assert_close(params_of(model), params_of(twin), rtol=0, atol=0)
