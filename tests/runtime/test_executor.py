"""The wrapper's contract: weight sync, re-run checks, modes, buffers and every error."""
import copy

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch
from pipetorch.errors import CompileError, ConfigError, DeviceError
from helpers.reference import plain_train_call
from helpers.models import BatchNormNet, MnistNetwork, TinyMLP, WithLoss, data, mnist_data


def quiet(opts=None):
    return (opts or poptorch.Options()).showCompilationProgressBar(False)


def sgd(model, lr=0.1):
    return torch.optim.SGD(model.parameters(), lr=lr)


def test_host_weights_sync_lazily_and_once():
    torch.manual_seed(0)
    model = TinyMLP()
    before = model.fc1.weight.detach().clone()
    wrapped = poptorch.trainingModel(model, quiet(), optimizer=sgd(model))
    wrapped(*data(4))
    generation = wrapped._weights.sync.generation
    device_weight = wrapped._compiled.engine.model.fc1.weight
    assert not torch.equal(device_weight, before)
    assert_close(model.fc1.weight, device_weight)  # first access copies back
    _ = model.state_dict(), list(model.parameters()), model(data(2)[0])
    assert wrapped._weights.sync.generation == generation + 1  # ... exactly once


def test_host_edits_reach_device_only_through_copy_weights_to_device():
    model = TinyMLP()
    wrapped = poptorch.trainingModel(model, quiet(), optimizer=sgd(model, lr=0.0))
    x, y = data(4)
    out1, _ = wrapped(x, y)
    with torch.no_grad():
        model.fc2.bias.add_(100.0)
    out2, _ = wrapped(x, y)
    assert_close(out1, out2)  # lr 0 and no upload: the device still has the old bias
    # the call superseded the edit: the host copy, and what it uploads, is the latest call's
    wrapped.copyWeightsToDevice()
    assert_close(wrapped(x, y)[0], out1)
    with torch.no_grad():
        model.fc2.bias.add_(100.0)
    wrapped.copyWeightsToDevice()
    out3, _ = wrapped(x, y)
    assert_close(out3, out1 + 100.0)


def test_detach_keeps_trained_weights_and_blocks_calls():
    model = TinyMLP()
    wrapped = poptorch.trainingModel(model, quiet(), optimizer=sgd(model))
    wrapped(*data(4))
    trained = wrapped._compiled.engine.model.fc1.weight.detach().clone()
    wrapped.detachFromDevice()
    assert not wrapped.isAttachedToDevice()
    assert torch.equal(model.fc1.weight.detach(), trained)
    with pytest.raises(DeviceError, match="attachToDevice"):
        wrapped(*data(4))
    wrapped.attachToDevice()
    wrapped(*data(4))


def test_inference_model_sees_trained_weights():
    torch.manual_seed(0)
    model = TinyMLP()
    training = poptorch.trainingModel(model, quiet(), optimizer=sgd(model))
    inference = poptorch.inferenceModel(model, quiet())
    x, y = data(4)
    training(x, y)
    assert_close(inference(x), model(x).detach())
    training(x, y)  # more training after the inference wrapper compiled
    assert_close(inference(x), model(x).detach())


def test_rerun_with_other_inputs_names_the_mismatch():
    wrapped = poptorch.trainingModel(TinyMLP(), quiet())
    x, y = data(4)
    wrapped(x, y)
    with pytest.raises(ValueError, match=r"argument 0 \(x\) changed shape from \[4, 6\] to "
                                         r"\[8, 6\].*destroy\(\)"):
        wrapped(*data(8))
    with pytest.raises(ValueError, match="changed dtype from torch.float32 to torch.float64"):
        wrapped(x.double(), y)
    wrapped(x, labels=y)  # as in PopTorch: by position or by keyword, one signature
    wrapped.destroy()
    wrapped(*data(8))  # a destroyed wrapper compiles again for the new inputs


def test_backward_on_an_output_explains():
    _, loss = poptorch.trainingModel(TinyMLP(), quiet())(*data(2))
    with pytest.raises(RuntimeError, match="already ran inside the call"):
        loss.backward()
    assert type(loss.numpy()).__name__ == "ndarray" and (loss * 2).__class__ is torch.Tensor


def test_wrapping_twice_for_training_is_an_error():
    model = TinyMLP()
    wrapped = poptorch.trainingModel(model, quiet())
    assert poptorch.inferenceModel(wrapped).model is model  # PopTorch wraps the wrapper's model
    with pytest.raises(ConfigError, match="destroy"):
        poptorch.trainingModel(model, quiet())
    with pytest.raises(ConfigError, match=r"Call model.destroy\(\)"):
        poptorch.trainingModel(wrapped, quiet())
    wrapped.destroy()
    poptorch.trainingModel(model, quiet())


def test_train_and_eval_modes():
    class Dropper(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x, y=None):
            out = nn.functional.dropout(self.fc(x), 0.5, self.training)
            return out if y is None else (out, nn.functional.cross_entropy(out, y))

    torch.manual_seed(0)
    model = Dropper()
    x, y = data(8)
    trained = copy.deepcopy(model)
    train_out, _ = poptorch.trainingModel(trained, quiet(), optimizer=sgd(trained, 0.0))(x, y)
    assert (train_out == 0).any()  # dropout active
    assert_close(poptorch.inferenceModel(model, quiet())(x), model.eval()(x).detach())


def test_buffers_persist_between_calls():
    torch.manual_seed(0)
    model = BatchNormNet()
    reference = copy.deepcopy(model).train()
    wrapped = poptorch.trainingModel(model, quiet(), optimizer=sgd(model, 0.0))
    for call in range(2):
        x, y = data(4, seed=call)
        wrapped(x, y)
        reference(x, y)
    assert_close(model.bn.running_mean, reference.bn.running_mean)
    assert model.bn.num_batches_tracked.item() == 2


def test_replicas_with_changing_buffers():
    opts = quiet(poptorch.Options().replicationFactor(2))
    with pytest.raises(ConfigError, match=r"changes buffers \['bn.running_mean'.*broadcastBuffers\(False\)"):
        poptorch.trainingModel(BatchNormNet(), opts)(*data(4))
    torch.manual_seed(0)
    model = BatchNormNet()
    reference = copy.deepcopy(model)
    opts = quiet(poptorch.Options().replicationFactor(2).broadcastBuffers(False))
    poptorch.trainingModel(model, opts, optimizer=sgd(model, 0.0))(*data(4))
    x, y = data(4)
    reference(x[:2], y[:2])  # replica 0's micro-batch only: its buffers come back to the host
    assert_close(model.bn.running_mean, reference.bn.running_mean)


def test_missing_loss():
    class NoLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            return self.fc(x)

    with pytest.raises(CompileError, match="Couldn't find a loss in graph!"):
        poptorch.trainingModel(NoLoss(), quiet())(data(2)[0])


def test_identity_loss_counts_as_loss():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            out = self.fc(x)
            return out, poptorch.identity_loss(out.pow(2).mean(dim=1), reduction="mean")

    torch.manual_seed(0)
    model = Custom()
    reference = copy.deepcopy(model)
    x = data(2)[0]
    _, loss = poptorch.trainingModel(model, quiet(), optimizer=sgd(model))(x)
    ref_loss = reference.fc(x).pow(2).mean()
    ref_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert_close(loss, ref_loss.detach())
    assert_close(model.fc.weight, reference.fc.weight)


def test_no_active_block():
    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x, y):
            with poptorch.Block("B1", ipu_id=0):
                x = self.fc(x)
            x = torch.relu(x)  # outside any block, after one ended
            with poptorch.Block("B2", ipu_id=1):
                return x, nn.functional.cross_entropy(x, y)

    with pytest.raises(CompileError, match="No active Block: 'relu' runs after block 'B1' ended"):
        poptorch.trainingModel(Leaky(), quiet())(*data(2))


def test_inference_requires_no_accumulation():
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(ConfigError, match=r"gradientAccumulation to 1.*inferenceModel.*It is 2"):
        poptorch.inferenceModel(TinyMLP(), opts)


def test_batch_not_divisible_names_the_factors():
    opts = quiet(poptorch.Options().deviceIterations(2).replicationFactor(2))
    opts.Training.gradientAccumulation(3)
    with pytest.raises(ValueError, match=r"shape \[10, 6\].*deviceIterations \(2\) x gradientAccumulation \(3\) x replicationFactor \(2\) = 12"):
        poptorch.trainingModel(TinyMLP(), opts)(*data(10))


def test_options_freeze_and_executor_keeps_its_own_copy():
    opts = quiet()
    wrapped = poptorch.trainingModel(TinyMLP(), opts)
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.deviceIterations(2)
    assert opts.output_mode == poptorch.OutputMode.Default
    assert wrapped.options.output_mode == poptorch.OutputMode.Final
    opts.clone().deviceIterations(2)  # a clone can change


def test_set_optimizer_changes_learning_rate():
    torch.manual_seed(0)
    model = TinyMLP()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    wrapped = poptorch.trainingModel(model, quiet(), optimizer=opt)
    for call, lr in enumerate([0.1, 0.01, 0.5]):
        for group in opt.param_groups:
            group["lr"] = lr
        wrapped.setOptimizer(opt)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        x, y = data(4, seed=call)
        _, loss = wrapped(x, y)
        ref_opt.zero_grad()
        ref_loss = reference(x, y)[1]
        ref_loss.backward()
        ref_opt.step()
        assert_close(loss, ref_loss.detach())
    assert_close(model.fc1.weight, reference.fc1.weight)


def test_default_optimizer_is_sgd_lr_001_and_frozen_params_stay():
    torch.manual_seed(0)
    model = TinyMLP()
    model.fc1.weight.requires_grad_(False)
    reference = copy.deepcopy(model)
    frozen = model.fc1.weight.detach().clone()
    wrapped = poptorch.trainingModel(model, quiet())
    x, y = data(4)
    wrapped(x, y)
    reference(x, y)[1].backward()
    torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.01).step()
    assert torch.equal(model.fc1.weight, frozen)
    assert_close(model.fc2.weight, reference.fc2.weight)


def test_state_dict_and_checkpoint_of_optimiser_state():
    torch.manual_seed(0)
    model = TinyMLP()
    reference = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    wrapped = poptorch.trainingModel(model, quiet(), optimizer=opt)
    x, y = data(4)
    wrapped(x, y)
    ref_opt.zero_grad()
    reference(x, y)[1].backward()
    ref_opt.step()
    assert_close(wrapped.state_dict()["fc1.weight"], reference.fc1.weight.detach())
    wrapped.copyWeightsToHost()
    ref_state = ref_opt.state_dict()["state"]
    for index, state in opt.state_dict()["state"].items():
        assert_close(state["exp_avg"], ref_state[index]["exp_avg"])
    new = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    wrapped.load_state_dict(new)
    assert torch.equal(wrapped._compiled.engine.model.fc1.weight, torch.zeros_like(model.fc1.weight))


def test_methods_and_attributes_forwarded():
    model = TinyMLP()
    wrapped = poptorch.trainingModel(model, quiet())
    assert wrapped.model is model and wrapped.fc1 is model.fc1
    assert not wrapped.isCompiled()
    wrapped.compile(*data(2))
    assert wrapped.isCompiled()
    assert "trainingModel" in repr(wrapped)


def test_is_running_on_ipu_inside_the_call():
    seen = []

    class Probe(TinyMLP):
        def forward(self, x, labels=None):
            seen.append(poptorch.isRunningOnIpu())
            return super().forward(x, labels)

    model = Probe()
    poptorch.inferenceModel(model, quiet())(data(2)[0])
    model(data(2)[0])
    assert seen[-2:] == [True, False]


def test_strategy_does_not_change_numbers():
    torch.manual_seed(0)
    base = WithLoss(MnistNetwork())
    x, y = mnist_data(24)
    results = {}
    for name, strategy in [
        ("single", None),
        ("sharded", poptorch.ShardedExecution(poptorch.Stage("B1", "B2").ipu(0), poptorch.Stage("B3", "B4").ipu(1))),
        ("pipelined", poptorch.PipelinedExecution(poptorch.Stage("B1", "B2").ipu(0), poptorch.Stage("B3", "B4").ipu(1))),
    ]:
        model = copy.deepcopy(base)
        opts = quiet(poptorch.Options().deviceIterations(2))
        opts.Training.gradientAccumulation(3)
        opts.setExecutionStrategy(strategy or poptorch.ShardedExecution(poptorch.Stage("B1", "B2", "B3", "B4")))
        wrapped = poptorch.trainingModel(model, opts, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        _, loss = wrapped(x, y)
        results[name] = (loss, model.state_dict())
    for name in ("sharded", "pipelined"):
        assert_close(results[name][0], results["single"][0])
        for key, value in results["single"][1].items():
            assert_close(results[name][1][key], value)


def test_pipelined_training_with_too_little_accumulation():
    opts = quiet().setExecutionStrategy(
        poptorch.PipelinedExecution(poptorch.Stage("B1", "B2").ipu(0), poptorch.Stage("B3", "B4").ipu(1)))
    opts.Training.gradientAccumulation(2)
    with pytest.raises(ConfigError, match=r"gradientAccumulation \(2\) must be >= 2\*stages-1 \(3\)"):
        poptorch.trainingModel(WithLoss(MnistNetwork()), opts)(*mnist_data(2))


def test_recomputation_trains_like_plain_pytorch():
    class Checkpointed(TinyMLP):
        def forward(self, x, labels):
            h = poptorch.recomputationCheckpoint(torch.relu(self.fc1(x)))
            out = self.fc2(h)
            return out, self.loss(out, labels)

    torch.manual_seed(0)
    model = Checkpointed()
    reference = copy.deepcopy(model)
    x, y = data(4)
    _, loss = poptorch.trainingModel(model, quiet(), optimizer=sgd(model))(x, y)
    ref_loss = reference(x, y)[1]
    ref_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert_close(loss, ref_loss.detach())
    assert_close(model.fc1.weight, reference.fc1.weight)


def test_synthetic_data_ignores_host_inputs():
    torch.manual_seed(0)
    model = TinyMLP()
    opts = quiet(poptorch.Options().deviceIterations(2).enableSyntheticData(True))
    wrapped = poptorch.inferenceModel(model, opts)
    first = wrapped(torch.zeros(4, 6))
    second = wrapped(torch.ones(4, 6))
    assert_close(first, second)  # the device generates its own inputs of the compiled shape
    assert not torch.allclose(first, model(torch.zeros(4, 6)).detach())


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop"])
def test_pipetorch_optimisers_with_loss_scaling_match_torch(name):
    torch.manual_seed(0)
    model = TinyMLP()
    reference = copy.deepcopy(model)
    opts = quiet()
    opts.Training.gradientAccumulation(2)
    opt = getattr(poptorch.optim, name)(model.parameters(), lr=0.01, loss_scaling=1024.0)
    ref_opt = getattr(torch.optim, name)(reference.parameters(), lr=0.01)
    wrapped = poptorch.trainingModel(model, opts, optimizer=opt)
    for call in range(3):
        x, y = data(8, seed=call)
        wrapped(x, y)
        plain_train_call(reference, ref_opt, x, y, D=1, G=2, R=1)
    for key, value in reference.state_dict().items():
        assert_close(model.state_dict()[key], value, msg=key)


def test_begin_block_model_is_pipelined_over_two_devices():
    torch.manual_seed(0)
    model = TinyMLP()
    poptorch.BeginBlock(model.fc2, ipu_id=1)
    opts = quiet()
    opts.Training.gradientAccumulation(3)
    wrapped = poptorch.trainingModel(model, opts)
    wrapped(*data(6))
    assert [(s.ipu_id, s.block_ids) for s in wrapped._compiled.stages] == [(0, ()), (1, ("0",))]
    other = TinyMLP()
    poptorch.BeginBlock(other.fc2, ipu_id=1)
    with pytest.raises(ConfigError, match=r"gradientAccumulation \(1\) must be >= 2\*stages-1 \(3\)"):
        poptorch.trainingModel(other, quiet())(*data(2))  # G=1: too little for 2 stages
