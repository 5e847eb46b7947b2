"""Optimiser state dtypes (accum types) and velocity scaling: stored as asked, numbers kept."""
import pytest
import torch

import pipetorch as poptorch
from optim_harness import CASES, batches, make_model, params_of, state_tensors, train

# The state-dtype arguments each optimiser takes (SGD's momentum case has a velocity).
STATE_DTYPE_ARGS = {
    poptorch.optim.SGD: ("accum_type", "velocity_accum_type"),
    poptorch.optim.Adam: ("accum_type", "first_order_momentum_accum_type",
                          "second_order_momentum_accum_type"),
}
STATE_DTYPE_ARGS[poptorch.optim.AdamW] = STATE_DTYPE_ARGS[poptorch.optim.Adam]
STATE_DTYPE_ARGS[poptorch.optim.RMSprop] = STATE_DTYPE_ARGS[poptorch.optim.Adam]
STATE_DTYPE_ARGS[poptorch.optim.LAMB] = STATE_DTYPE_ARGS[poptorch.optim.Adam]
STATEFUL_CASES = [case for case in CASES if case.name != "SGD"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", STATEFUL_CASES, ids=repr)
def test_low_precision_state_is_stored_low_and_stays_close_to_float32(case, dtype):
    model = make_model()
    ours, twin, reference = case.build(model, **dict.fromkeys(STATE_DTYPE_ARGS[case.ours], dtype))
    data = batches()
    losses = train(model, ours, data)
    states = state_tensors(ours)
    assert states and {t.dtype for t in states.values()} == {dtype}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tolerance = dict(rtol=0.0, atol=2e-2 if dtype == torch.bfloat16 else 2e-3)
    torch.testing.assert_close(losses, train(twin, reference, data), **tolerance)
    torch.testing.assert_close(params_of(model), params_of(twin), **tolerance)
    assert any(not torch.equal(a, b) for a, b in zip(params_of(model), params_of(twin))), \
        "the low-precision state must have changed the numbers a little"


F32 = torch.float32


@pytest.mark.parametrize("cls, kwargs", [
    (poptorch.optim.SGD, dict(lr=0.1, momentum=0.9, velocity_accum_type=F32)),
    (poptorch.optim.Adam, dict(lr=0.01, eps=1e-3, first_order_momentum_accum_type=F32,
                               second_order_momentum_accum_type=F32)),
    (poptorch.optim.RMSprop, dict(lr=0.01, momentum=0.5, eps=1e-3, accum_type=F32,
                                  first_order_momentum_accum_type=F32,
                                  second_order_momentum_accum_type=F32)),
    (poptorch.optim.LAMB, dict(lr=0.01, eps=1e-3, first_order_momentum_accum_type=F32,
                               second_order_momentum_accum_type=F32)),
], ids=lambda value: getattr(value, "__name__", ""))
def test_float32_state_for_a_float16_model_tracks_float32_training(cls, kwargs):
    model, model32 = make_model(torch.float16), make_model()
    optimizer = cls(model.parameters(), **kwargs)
    losses = train(model, optimizer, batches(torch.float16))
    losses32 = train(model32, cls(model32.parameters(), **kwargs), batches())
    assert {t.dtype for t in state_tensors(optimizer).values()} == {F32}
    assert all(p.dtype == torch.float16 for p in model.parameters())
    torch.testing.assert_close([loss.float() for loss in losses], losses32, rtol=0, atol=2e-2)
    torch.testing.assert_close([p.float() for p in params_of(model)], params_of(model32),
                               rtol=0, atol=2e-2)


def test_low_precision_state_survives_a_state_dict_round_trip():
    model = make_model()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01,
                                    first_order_momentum_accum_type=torch.float16)
    train(model, optimizer, batches(steps=2))
    saved = {k: v.clone() for k, v in state_tensors(optimizer).items()}
    rebuilt = poptorch.optim.Adam(model.parameters(), **optimizer.defaults)
    rebuilt.load_state_dict(optimizer.state_dict())
    loaded = state_tensors(rebuilt)
    assert {k: v.dtype for k, v in loaded.items()} == {k: v.dtype for k, v in saved.items()}
    assert {v.dtype for v in saved.values()} == {torch.float16, torch.float32}
    torch.testing.assert_close(loaded, saved, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [poptorch.optim.Adam, poptorch.optim.RMSprop])
def test_float32_state_of_a_float16_model_survives_a_state_dict_round_trip(cls):
    # torch's load_state_dict casts float state to the parameter's dtype: a float16 model's
    # float32 moments came back rounded to float16.
    model = make_model(torch.float16)
    optimizer = cls(model.parameters(), lr=0.01, momentum=0.5) if cls is poptorch.optim.RMSprop \
        else cls(model.parameters(), lr=0.01)
    train(model, optimizer, batches(torch.float16, steps=2))
    saved = {k: v.clone() for k, v in state_tensors(optimizer).items()}
    assert {v.dtype for v in saved.values()} == {F32}
    assert any((v.half().float() != v).any() for v in saved.values()), \
        "some state must not fit float16 for the test to bite"
    rebuilt = cls(model.parameters(), **optimizer.defaults)
    rebuilt.load_state_dict(optimizer.state_dict())
    torch.testing.assert_close(state_tensors(rebuilt), saved, rtol=0, atol=0)


@pytest.mark.parametrize("velocity_scaling", [3.0, 1 / 7])
def test_velocity_scaling_only_scales_the_stored_velocity(velocity_scaling):
    model = make_model()
    ours, twin, reference = CASES[1].build(model, use_combined_accum=True,
                                           velocity_scaling=velocity_scaling)
    data = batches()
    torch.testing.assert_close(train(model, ours, data), train(twin, reference, data))
    torch.testing.assert_close(params_of(model), params_of(twin))
    ours_buffers = [ours.state[p]["momentum_buffer"] for p in model.parameters()]
    torch_buffers = [reference.state[p]["momentum_buffer"] * velocity_scaling
                     for p in twin.parameters()]
    torch.testing.assert_close(ours_buffers, torch_buffers)


def test_velocity_scaling_can_differ_per_group():
    model = make_model()
    groups = [{"params": list(model[0].parameters()), "velocity_scaling": 4.0},
              {"params": list(model[2].parameters())}]
    optimizer = poptorch.optim.SGD(groups, lr=0.1, momentum=0.9, use_combined_accum=True)
    reference_model = make_model()
    reference = torch.optim.SGD(reference_model.parameters(), lr=0.1, momentum=0.9)
    train(model, optimizer, batches(steps=3))
    train(reference_model, reference, batches(steps=3))
    ratios = [(optimizer.state[ours]["momentum_buffer"]
               / reference.state[theirs]["momentum_buffer"]).mean().item()
              for ours, theirs in zip(model.parameters(), reference_model.parameters())]
    assert ratios == pytest.approx([4.0, 4.0, 1.0, 1.0], rel=1e-4)


def test_velocity_scaling_without_the_combined_variant_is_ignored_with_a_warning(caplog):
    model = make_model()
    ours, twin, reference = CASES[1].build(model, velocity_scaling=3.0)
    # PopTorch's exact warning (python/optim.py's SGD), then the value.
    assert ("velocity_scaling value ignored when using the separate variant "
            "(use_combined_accum=False). In future, this will lead to an error. Please update "
            "your code. (velocity_scaling=3.0)") in caplog.text
    data = batches(steps=3)
    torch.testing.assert_close(train(model, ours, data), train(twin, reference, data),
                               rtol=0, atol=0)
