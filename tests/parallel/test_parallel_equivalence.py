"""Stages in worker processes give the numbers of plain PyTorch and of the in-process reference."""
import pytest
import torch

import pipetorch as poptorch
from parallel_cases import (
    BUILDERS, assert_in_processes, assert_same_result, assert_same_state, cleaned, local_wrapper,
    one_thread_everywhere, options, plain_call, skip_case, twin,
)

D, B, CALLS = 2, 2, 2


@pytest.fixture(autouse=True)
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adam(model):
    # A large eps: parameters whose gradient is 0 up to rounding (the attention's key bias)
    # would otherwise move by lr * sign(rounding noise) and differ between any two runs.
    return torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3)


# Every model runs pipelined and sharded, over 2 and over 4 devices, without running the
# whole product (each 4-stage wrapper costs four torch start-ups on a 2-core machine).
TRAINING = [
    pytest.param("mnist", 2, False, "All", sgd, id="mnist-2-pipelined-All-sgd"),
    pytest.param("mnist", 4, True, "Final", adam, id="mnist-4-sharded-Final-adam"),
    pytest.param("resnet", 2, True, "Sum", sgd, id="resnet-2-sharded-Sum-sgd"),
    pytest.param("resnet", 4, False, "All", adam, id="resnet-4-pipelined-All-adam"),
    pytest.param("transformer", 2, False, "EveryN", adam, id="transformer-2-pipelined-EveryN-adam"),
    pytest.param("transformer", 4, True, "All", sgd, id="transformer-4-sharded-All-sgd"),
    # h from stage 0 is read in stage 2; stage 1 starts with ReLU(inplace=True) on its input.
    pytest.param("skip", 3, False, "Final", sgd, id="skip-3-pipelined-Final-sgd"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, count, sharded, mode, make_optimizer", TRAINING)
def test_training_matches_plain_pytorch_and_the_local_engine(request, monkeypatch, name, count,
                                                             sharded, mode, make_optimizer):
    case = BUILDERS[name](count)
    local_model, plain = twin(case.model), twin(case.model)
    G = count if sharded else 2 * count - 1
    period = 2 if mode == "EveryN" else None
    batches = [case.data(D * G * B, seed=seed) for seed in range(CALLS)]

    def build(model):
        opts = options(case, sharded=sharded, D=D, G=G, mode=mode, period=period)
        wrapped = poptorch.trainingModel(model, opts, optimizer=make_optimizer(model))
        return cleaned(request, wrapped)

    wrapper = build(case.model)
    results = [wrapper(*batch) for batch in batches]
    assert_in_processes(wrapper, count)
    local, first = local_wrapper(monkeypatch, lambda: build(local_model), batches[0])
    local_results = [first] + [local(*batch) for batch in batches[1:]]
    plain_optimizer = make_optimizer(plain)
    for call, (batch, got, from_local) in enumerate(zip(batches, results, local_results)):
        assert_same_result(got, from_local, what=f"call {call} vs local")
        expected = plain_call(plain, plain_optimizer, batch, D=D, G=G, mode=mode, period=period)
        assert_same_result(got, expected, what=f"call {call} vs plain PyTorch")
    assert_same_state(wrapper.model, local.model, what="vs local: ")
    assert_same_state(wrapper.model, plain, what="vs plain PyTorch: ")


INFERENCE = [
    pytest.param("mnist", 2, False, 3, id="mnist-2-pipelined-D3"),
    pytest.param("resnet", 2, True, 2, id="resnet-2-sharded-D2"),
    pytest.param("skip", 3, False, 3, id="skip-3-pipelined-D3"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, count, sharded, device_iterations", INFERENCE)
def test_inference_matches_the_model_in_eval_mode(request, name, count, sharded,
                                                  device_iterations):
    case = BUILDERS[name](count)
    with torch.no_grad():  # move BatchNorm statistics away from 0/1 so eval mode is tested
        case.model(case.data(8, seed=9)[0])
    plain = twin(case.model).eval()
    opts = options(case, sharded=sharded, D=device_iterations)
    wrapper = cleaned(request, poptorch.inferenceModel(case.model, opts))
    for seed in range(CALLS):
        inputs, _ = case.data(device_iterations * B, seed=seed)
        got = wrapper(inputs)
        with torch.no_grad():
            expected = plain(inputs)
        assert_same_result(got, expected, what=f"call {seed}")
    assert_in_processes(wrapper, count)
    assert_same_state(case.model, plain)  # eval mode: no statistics changed


@pytest.mark.slow
def test_in_place_op_on_a_relayed_value_is_seen_by_the_later_stage(request, monkeypatch):
    # Stage 1 rectifies h in place (ReLU(inplace=True)) and relays it to stage 2, which must
    # read the rectified h as plain PyTorch and the local engine do; the workers sent the
    # value stage 1 received instead (stage.py clones inputs changed in place).
    case = skip_case(mutate_relayed=True)
    local_model, plain = twin(case.model), twin(case.model)
    G = 3
    batches = [case.data(D * G * B, seed=seed) for seed in range(CALLS)]

    def build(model):
        opts = options(case, sharded=True, D=D, G=G)
        return cleaned(request, poptorch.trainingModel(model, opts, optimizer=sgd(model)))

    local, first = local_wrapper(monkeypatch, lambda: build(local_model), batches[0])
    local_results = [first] + [local(*batch) for batch in batches[1:]]
    plain_optimizer = sgd(plain)
    for call, (batch, from_local) in enumerate(zip(batches, local_results)):
        expected = plain_call(plain, plain_optimizer, batch, D=D, G=G)
        assert_same_result(from_local, expected, what=f"local call {call} vs plain PyTorch")
    wrapper = build(case.model)
    results = [wrapper(*batch) for batch in batches]
    assert_in_processes(wrapper, 3)
    for call, (got, from_local) in enumerate(zip(results, local_results)):
        assert_same_result(got, from_local, what=f"call {call} vs local")
    assert_same_state(wrapper.model, plain)
