"""The weights API over worker processes: lazy copies to the host, uploads, optimisers, replicas."""
import os

import pytest
import torch
from torch.testing import assert_close

import pipetorch as poptorch
from parallel_cases import (
    assert_in_processes, assert_same_result, assert_same_state, cleaned, local_wrapper,
    mnist_case, one_thread_everywhere, options, plain_call, resnet_case, twin,
)
from pipetorch.errors import DeviceError

D, B = 2, 2


@pytest.fixture(autouse=True)
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


def sgd(model, lr=0.05):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3)


class Trio:
    """One seeded model three times: in worker processes, in the local engine, in plain PyTorch.

    `call` runs one host call on all three and checks that they return the same outputs.
    """

    def __init__(self, request, monkeypatch, case, *, make_optimizer, R=1, G=3):
        self.request, self.monkeypatch, self.case = request, monkeypatch, case
        self.R, self.G = R, G
        self.local_model, self.plain = twin(case.model), twin(case.model)
        self.optimizer = make_optimizer(case.model)
        self.local_optimizer = make_optimizer(self.local_model)
        self.plain_optimizer = make_optimizer(self.plain)
        self.wrapper = self._build(case.model, self.optimizer)
        self.local = None

    def _build(self, model, optimizer):
        opts = options(self.case, sharded=False, D=D, G=self.G, R=self.R)
        return cleaned(self.request, poptorch.trainingModel(model, opts, optimizer=optimizer))

    def call(self, seed):
        batch = self.case.data(D * self.G * self.R * B, seed=seed)
        got = self.wrapper(*batch)
        if self.local is None:
            build = lambda: self._build(self.local_model, self.local_optimizer)  # noqa: E731
            self.local, from_local = local_wrapper(self.monkeypatch, build, batch)
            assert_in_processes(self.wrapper, self.case.count * self.R)
        else:
            from_local = self.local(*batch)
        assert_same_result(got, from_local, what=f"call {seed} vs local")
        expected = plain_call(self.plain, self.plain_optimizer, batch, D=D, G=self.G, R=self.R)
        assert_same_result(got, expected, what=f"call {seed} vs plain PyTorch")
        return got

    def models(self):
        return self.wrapper.model, self.local.model, self.plain

    def assert_same_weights(self):
        assert_same_state(self.wrapper.model, self.local.model, what="vs local: ")
        assert_same_state(self.wrapper.model, self.plain, what="vs plain PyTorch: ")


def count_pulls(monkeypatch, wrapper):
    """A list that grows by one each time the wrapper copies the workers' weights to the host:
    "weights", or "state" for a copy of the optimiser state with them."""
    engine, pulls = wrapper._compiled.engine, []
    pull = engine.pull

    def counting(*, optimizer_state=False):
        pulls.append("state" if optimizer_state else "weights")
        pull(optimizer_state=optimizer_state)

    monkeypatch.setattr(engine, "pull", counting)
    return pulls


@torch.no_grad()
def edit(model, scale):
    """A host edit touching both stages of the 2-stage MNIST split."""
    model.model.layer1.conv.bias.add_(0.1 * scale)
    model.model.layer3.weight.mul_(scale)


def assert_same_optimizer_state(got, want):
    got_state, want_state = got.state_dict(), want.state_dict()
    assert sorted(got_state["state"]) == sorted(want_state["state"])
    for index, values in want_state["state"].items():
        assert sorted(got_state["state"][index]) == sorted(values)
        for key, value in values.items():
            assert_close(got_state["state"][index][key], value,
                         msg=lambda m, index=index, key=key: f"param {index} {key}: {m}")
    for got_group, want_group in zip(got_state["param_groups"], want_state["param_groups"]):
        assert got_group == want_group


@pytest.mark.slow
def test_trained_weights_and_adam_state_reach_the_host_once_on_first_access(request, monkeypatch):
    trio = Trio(request, monkeypatch, mnist_case(2), make_optimizer=adam)
    trio.call(0)
    pulls = count_pulls(monkeypatch, trio.wrapper)
    trio.call(1)
    assert pulls == [] and trio.optimizer.state == {}  # nothing copied back yet
    state = trio.wrapper.model.state_dict()
    list(trio.wrapper.model.parameters())
    trio.wrapper.model.model.layer4.weight.sum()
    assert len(pulls) == 1
    assert_same_state(trio.wrapper.model, trio.local.model, what="vs local: ")
    for name, value in trio.plain.state_dict().items():
        assert_close(state[name], value, msg=lambda m, name=name: f"{name}: {m}")
    trio.wrapper.copyWeightsToHost()
    trio.local.copyWeightsToHost()
    assert pulls == ["weights", "weights"] and trio.optimizer.state == {}  # weights only
    # Reading the optimiser brings its state: the user's Adam holds the workers' exp_avg,
    # exp_avg_sq and step for every parameter.
    assert len(trio.optimizer.state_dict()["state"]) == len(list(trio.plain.parameters()))
    assert pulls == ["weights", "weights", "state"]
    trio.optimizer.state_dict()
    assert len(pulls) == 3  # nothing newer on the device
    assert_same_optimizer_state(trio.optimizer, trio.local_optimizer)
    assert_same_optimizer_state(trio.optimizer, trio.plain_optimizer)
    trio.assert_same_weights()


@pytest.mark.slow
def test_host_weights_reach_the_workers_only_through_copyWeightsToDevice(request, monkeypatch):
    trio = Trio(request, monkeypatch, mnist_case(2), make_optimizer=sgd)
    trio.call(0)
    user, local_user, _ = trio.models()
    edit(user, 0.5)
    edit(local_user, 0.5)  # not uploaded: the next call trains the workers' weights, as plain does
    trio.call(1)
    trio.assert_same_weights()  # the call's weights replaced the host edit
    for model in trio.models():
        edit(model, 0.5)
    trio.wrapper.copyWeightsToDevice()
    trio.local.copyWeightsToDevice()
    trio.call(2)
    trio.assert_same_weights()
    fresh = mnist_case(2).model
    edit(fresh, 2.0)
    for target in (trio.wrapper, trio.local, trio.plain):
        target.load_state_dict(fresh.state_dict())
    assert_same_state(trio.wrapper.model, fresh)
    trio.call(3)
    trio.assert_same_weights()


@pytest.mark.slow
def test_setOptimizer_changes_the_workers_learning_rate_and_keeps_momentum(request, monkeypatch):
    trio = Trio(request, monkeypatch, mnist_case(2), make_optimizer=sgd)
    trio.call(0)
    trio.optimizer.param_groups[0]["lr"] = 0.5  # without setOptimizer the workers never see it
    trio.local_optimizer.param_groups[0]["lr"] = 0.5
    trio.call(1)
    user, local_user, _ = trio.models()
    replacement, local_replacement = sgd(user, lr=0.01), sgd(local_user, lr=0.01)
    trio.wrapper.setOptimizer(replacement)
    trio.local.setOptimizer(local_replacement)
    for group in trio.plain_optimizer.param_groups:
        group["lr"] = 0.01  # the momentum buffers stay, as they do on the workers
    trio.call(2)
    replacement.param_groups[0]["lr"] = 0.2
    local_replacement.param_groups[0]["lr"] = 0.2
    trio.wrapper.setOptimizer(replacement)
    trio.local.setOptimizer(local_replacement)
    trio.plain_optimizer.param_groups[0]["lr"] = 0.2
    trio.call(3)
    trio.assert_same_weights()


@pytest.mark.slow
def test_inference_model_of_the_trained_model_follows_its_training(request, monkeypatch):
    case = resnet_case(2)
    trio = Trio(request, monkeypatch, case, make_optimizer=sgd)
    trio.call(0)
    inference = cleaned(request, poptorch.inferenceModel(trio.wrapper.model,
                                                         options(case, sharded=True, D=D)))
    images, _ = case.data(D * B, seed=7)
    answers = []
    for seed in (1, 2):
        got = inference(images)
        with torch.no_grad():
            expected = twin(trio.plain).eval()(images)
        assert_same_result(got, expected, what=f"inference after call {seed - 1}")
        answers.append(got)
        trio.call(seed)
    assert_in_processes(inference, 2)
    assert not torch.allclose(answers[0], answers[1])  # it followed the second call's weights
    trio.assert_same_weights()  # BatchNorm statistics included


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_detach_stops_the_workers_and_attach_restarts_them_with_host_edits(request, monkeypatch):
    trio = Trio(request, monkeypatch, mnist_case(2), make_optimizer=sgd)
    trio.call(0)
    engine = trio.wrapper._compiled.engine
    before = list(engine.worker_pids)
    trio.wrapper.detachFromDevice()
    trio.local.detachFromDevice()
    assert not trio.wrapper.isAttachedToDevice()
    assert engine.worker_pids == [] and not any(alive(pid) for pid in before)
    trio.assert_same_weights()  # the user's model holds the trained weights
    with pytest.raises(DeviceError, match="detached from its device: call attachToDevice"):
        trio.wrapper(*trio.case.data(D * 3 * B, seed=1))
    for model in trio.models():
        edit(model, 0.25)
    trio.wrapper.attachToDevice()
    trio.local.attachToDevice()
    assert trio.wrapper.isAttachedToDevice()
    assert len(engine.worker_pids) == 2 and not set(engine.worker_pids) & set(before)
    trio.call(1)  # the edit and the momentum buffers reached the new workers
    trio.assert_same_weights()


@pytest.mark.slow
def test_replicated_pipelined_run_matches_the_reference(request, monkeypatch):
    # One worker per stage and replica; each replica's workers count its own micro-batches.
    trio = Trio(request, monkeypatch, mnist_case(2), make_optimizer=sgd, R=2)
    out, loss = trio.call(0)
    assert out.shape == (D * 3 * 2 * B, 10) and loss.shape == (D * 3 * 2,)
    trio.call(1)
    trio.assert_same_weights()
    traces = trio.wrapper._compiled.engine.last_trace
    assert [(t.stage, t.replica) for t in traces] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for trace in traces:
        forwards = sorted(span.micro_batch for span in trace.spans if span.kind == "F")
        assert forwards == list(range(D * 3)), trace.stage
        assert sum(span.kind == "AR" for span in trace.spans) == D
