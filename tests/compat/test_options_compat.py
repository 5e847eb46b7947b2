"""Issue 17, group 2: options PopTorch scripts use, with PopTorch's documented behaviour."""
import copy
import logging

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import Shifted, TinyMLP, data


def _plain_steps(model, x, y, *, G, B, lr, loss_scaling=1.0):
    """Plain PyTorch SGD over len(x)/(G*B) steps of G micro-batches (mean reduction).
    Returns each micro-batch's loss, the last step's gradients (times loss_scaling) and the
    last micro-batch's fc1 output."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, steps = [], len(x) // (G * B)
    for d in range(steps):
        optimizer.zero_grad()
        for g in range(G):
            i = (d * G + g) * B
            hidden = model.fc1(x[i:i + B])
            _, loss = model(x[i:i + B], y[i:i + B])
            (loss / G).backward()
            losses.append(loss.detach())
        grads = {n: p.grad.clone() * loss_scaling for n, p in model.named_parameters()}
        optimizer.step()
    return torch.stack(losses), grads, hidden.detach()


# -- anchorTensor / getAnchoredTensor / getTensorNames --------------------------------------
def _anchoring(D, G, **anchors):
    """Options running D steps of G micro-batches, anchoring the loss of every micro-batch
    as "losses" and each `short=long` name."""
    opts = poptorch.Options().deviceIterations(D)
    opts.Training.gradientAccumulation(G)
    opts.anchorTensor("losses", "loss", poptorch.OutputMode.All)
    for short, long in anchors.items():
        opts.anchorTensor(short, long)
    return opts


def test_anchored_loss_gradients_loss_scale_and_activation_in_process():
    torch.manual_seed(0)
    model = TinyMLP()
    plain = copy.deepcopy(model)
    D, G, B = 2, 2, 3
    x, y = data(D * G * B)
    # "hidden" is a named activation: the last micro-batch's fc1 output
    opts = _anchoring(D, G, grad_bias="Gradient___fc2.bias", grad_weight="Gradient___fc1.weight",
                      new_bias="UpdatedVar___fc2.bias", scale="finalLossScale", hidden="fc1")
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=4.0)
    wrapped = poptorch.trainingModel(model, opts, optimizer)
    with pytest.raises(RuntimeError, match="Model has not been compiled or has been destroyed"):
        wrapped.getTensorNames()
    wrapped(x, y)
    losses, grads, hidden = _plain_steps(plain, x, y, G=G, B=B, lr=0.1, loss_scaling=4.0)
    assert_close(wrapped.getAnchoredTensor("losses"), losses)
    # PopTorch's Gradient___ tensors are the gradients the optimiser receives: loss-scaled
    assert_close(wrapped.getAnchoredTensor("grad_bias"), grads["fc2.bias"])
    assert_close(wrapped.getAnchoredTensor("grad_weight"), grads["fc1.weight"])
    assert_close(wrapped.getAnchoredTensor("new_bias"), plain.fc2.bias.detach())
    assert wrapped.getAnchoredTensor("scale").item() == 4.0
    assert_close(wrapped.getAnchoredTensor("hidden"), hidden)
    names = wrapped.getTensorNames()
    assert {"loss", "finalLossScale", "Gradient___fc2.bias", "UpdatedVar___fc1.weight",
            "fc1.weight", "fc1"} <= set(names)
    with pytest.raises(KeyError, match="'nope' is not an anchored tensor"):
        wrapped.getAnchoredTensor("nope")
    wrapped.destroy()
    with pytest.raises(RuntimeError, match="Model has not been compiled or has been destroyed"):
        wrapped.getAnchoredTensor("losses")


def test_anchored_loss_every_n_steps_and_summed():
    torch.manual_seed(0)
    model = TinyMLP()
    plain = copy.deepcopy(model)
    x, y = data(8)
    opts = poptorch.Options().deviceIterations(4)
    opts.anchorTensor("every2", "loss", poptorch.OutputMode.EveryN, 2)
    opts.anchorTensor("total", "loss", poptorch.OutputMode.Sum)
    wrapped = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    wrapped(x, y)
    losses, _, _ = _plain_steps(plain, x, y, G=1, B=2, lr=0.1)
    assert_close(wrapped.getAnchoredTensor("every2"), losses[[1, 3]])
    assert_close(wrapped.getAnchoredTensor("total"), losses.sum())


def test_anchor_of_an_unknown_tensor_names_close_matches():
    opts = poptorch.Options()
    opts.anchorTensor("g", "Gradient___fc2.bais")
    wrapped = poptorch.trainingModel(TinyMLP(), opts)
    with pytest.raises(poptorch.errors.ConfigError, match="did you mean 'Gradient___fc2.bias'"):
        wrapped(*data(2))


def test_a_per_call_anchor_refuses_an_all_mode():
    opts = poptorch.Options()
    opts.anchorTensor("g", "Gradient___fc2.bias", poptorch.OutputMode.All)
    wrapped = poptorch.trainingModel(TinyMLP(), opts)
    with pytest.raises(poptorch.errors.ConfigError, match="anchor it with OutputMode.Final"):
        wrapped(*data(2))


@pytest.mark.slow
def test_anchors_of_a_pipelined_model_in_worker_processes(request, monkeypatch):
    monkeypatch.setenv("PIPETORCH_THREADS_PER_DEVICE", "1")
    torch.manual_seed(0)
    model = TinyMLP()
    poptorch.BeginBlock(model.fc2, "second", ipu_id=1)
    plain = copy.deepcopy(model)
    D, G, B = 1, 3, 2
    x, y = data(D * G * B)
    # fc1's gradient lives on worker 0, fc2's on worker 1
    opts = _anchoring(D, G, grad_first="Gradient___fc1.weight", grad_second="Gradient___fc2.bias",
                      scale="finalLossScale", new_weight="UpdatedVar___fc2.weight")
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=2.0)
    wrapped = poptorch.trainingModel(model, opts, optimizer)
    request.addfinalizer(wrapped.destroy)
    wrapped(x, y)
    assert wrapped._compiled.engine.worker_pids  # really in worker processes
    losses, grads, _ = _plain_steps(plain, x, y, G=G, B=B, lr=0.1, loss_scaling=2.0)
    assert_close(wrapped.getAnchoredTensor("losses"), losses)
    assert_close(wrapped.getAnchoredTensor("grad_first"), grads["fc1.weight"])
    assert_close(wrapped.getAnchoredTensor("grad_second"), grads["fc2.bias"])
    assert wrapped.getAnchoredTensor("scale").item() == 2.0
    assert_close(wrapped.getAnchoredTensor("new_weight"), plain.fc2.weight.detach())
    # module outputs are not listed for a model split over worker processes
    assert "fc1" not in wrapped.getTensorNames()
    opts = poptorch.Options().deviceIterations(2)
    opts.anchorTensor("hidden", "fc1")
    other = poptorch.inferenceModel(copy.deepcopy(model), opts)
    with pytest.raises(poptorch.errors.ConfigError, match="only when the model runs in this"):
        other(x[:4])
    assert not other.isCompiled()


# -- updatableNamedBuffers / copyNamedBuffersToDevice ----------------------------------------
def test_copy_named_buffers_to_device_sends_only_the_named_buffers():
    torch.manual_seed(0)
    model = Shifted()
    opts = poptorch.Options().updatableNamedBuffers(["shift"])
    wrapped = poptorch.inferenceModel(model, opts)
    x = torch.randn(3, 4)
    assert_close(wrapped(x), model(x))
    with torch.no_grad():
        model.shift.fill_(5.0)
    wrapped.copyNamedBuffersToDevice()
    assert_close(wrapped(x), model(x))  # the device uses the new shift
    assert opts.updatable_named_buffers == ["shift"]
    with pytest.raises(TypeError, match="a list of buffer names"):
        poptorch.Options().updatableNamedBuffers("shift")


def test_copy_named_buffers_needs_the_option_and_a_compiled_model():
    wrapped = poptorch.inferenceModel(Shifted())
    with pytest.raises(RuntimeError, match="Model has not been compiled"):
        wrapped.copyNamedBuffersToDevice()
    wrapped(torch.randn(2, 4))
    with pytest.raises(poptorch.errors.ConfigError, match="updatableNamedBuffers"):
        wrapped.copyNamedBuffersToDevice()


# -- maxRepeatLogs --------------------------------------------------------------------------
def test_max_repeat_logs_mutes_a_repeated_message(caplog):
    from pipetorch import log_level

    opts = poptorch.Options().maxRepeatLogs(2)
    assert opts.max_repeat_logs == 2
    poptorch.inferenceModel(TinyMLP(), opts)  # wrapping applies it
    chatty = logging.getLogger("pipetorch.runtime.executor")
    try:
        with caplog.at_level(logging.WARNING, logger="pipetorch"):
            for _ in range(6):
                chatty.warning("same message")
        repeats = [r.getMessage() for r in caplog.records if r.name == chatty.name]
        assert repeats == ["same message", "same message",
                           "same message (repeated 2 times; further repeats are muted)"]
    finally:
        log_level.limit_repeats(4)


def test_max_repeat_logs_mutes_a_flood_not_the_same_event_later(caplog):
    # A debug line of a real event ("Writing optimiser state tensors from IPU to host.") was
    # muted for the rest of the process after 4 copies, however far apart they were.
    from pipetorch import log_level

    log_level.limit_repeats(2)
    chatty = logging.getLogger("pipetorch.runtime.executor")
    try:
        with caplog.at_level(logging.WARNING, logger="pipetorch"):
            for message in ["flood"] * 4 + ["other", "flood"]:
                chatty.warning(message)
        assert [r.getMessage() for r in caplog.records if r.name == chatty.name] == [
            "flood", "flood", "flood (repeated 2 times; further repeats are muted)",
            "other", "flood"]
    finally:
        log_level.limit_repeats(4)


def test_max_repeat_logs_none_prints_every_repeat(caplog):
    # PopTorch's test_set_options passes maxRepeatLogs(None) (no limit); it was refused.
    from pipetorch import log_level

    opts = poptorch.Options().maxRepeatLogs(None)
    assert opts.max_repeat_logs is None
    poptorch.poptorch_core._validateOptions(opts.toDict())
    poptorch.inferenceModel(TinyMLP(), opts)  # wrapping applies it
    chatty = logging.getLogger("pipetorch.runtime.executor")
    try:
        with caplog.at_level(logging.WARNING, logger="pipetorch"):
            for _ in range(6):
                chatty.warning("same message")
        assert [r.getMessage() for r in caplog.records if r.name == chatty.name] == \
            ["same message"] * 6
    finally:
        log_level.limit_repeats(4)
    with pytest.raises(ValueError, match="maxRepeatLogs: number_repeated must be an int >= 0"):
        poptorch.Options().maxRepeatLogs(-1)


# -- Training.meanAccumulationAndReplicationReductionStrategy ---------------------------------
@pytest.mark.parametrize("accum_type, combined, expected", [
    (torch.float16, False, poptorch.MeanReductionStrategy.Running),
    (torch.float16, True, poptorch.MeanReductionStrategy.Post),
    (None, False, poptorch.MeanReductionStrategy.Post),
])
def test_mean_reduction_strategy_is_chosen_at_wrap_time(accum_type, combined, expected):
    model = TinyMLP()
    options = poptorch.Options()
    assert options.Training.meanAccumulationAndReplicationReductionStrategy == \
        poptorch.MeanReductionStrategy.Post
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.01, accum_type=accum_type,
                                   use_combined_accum=combined)
    poptorch.trainingModel(model, options, optimizer).compile(*data(2))
    assert options.Training.meanAccumulationAndReplicationReductionStrategy == expected


def test_explicit_mean_reduction_strategy_is_kept():
    model = TinyMLP()
    options = poptorch.Options()
    options.Training.setMeanAccumulationAndReplicationReductionStrategy(
        poptorch.MeanReductionStrategy.Running)
    poptorch.trainingModel(model, options).compile(*data(2))
    assert options.Training.meanAccumulationAndReplicationReductionStrategy == \
        poptorch.MeanReductionStrategy.Running


# -- Distributed --------------------------------------------------------------------------------
def test_distributed_attributes_as_poptorch_spells_them():
    opts = poptorch.Options()
    assert isinstance(opts.Distributed, poptorch.options._DistributedOptions)
    opts.Distributed.configureProcessId(1, 2)
    assert opts.Distributed.distributed_process_id == 1
    assert opts.Distributed.num_distributed_processes == 2
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (1, 2)
    for name in ("_TrainingOptions", "_PrecisionOptions", "_TensorLocationOptions", "_JitOptions"):
        assert hasattr(poptorch.options, name)


# -- numIOTiles -----------------------------------------------------------------------------
def test_num_io_tiles_validated_as_poptorch_does():
    options = poptorch.Options()
    message = "numIOTiles must be an even number between 32 and 192."
    for bad in (10, 193, 33):
        with pytest.raises(AssertionError, match=message):
            options.TensorLocations.numIOTiles(bad)
    for good in (32, 192, 100):
        options.TensorLocations.numIOTiles(good)


# -- outputMode with a period -----------------------------------------------------------------
def test_output_mode_accepts_a_period_with_any_mode(caplog):
    opts = poptorch.Options().deviceIterations(2)
    with caplog.at_level(logging.WARNING, logger="pipetorch"):
        opts.outputMode(poptorch.OutputMode.All, 3)
    assert "output_return_period (3) is ignored" in caplog.text
    assert opts.output_mode == poptorch.OutputMode.All and opts.output_return_period == 1
    model = TinyMLP()
    x, _ = data(4)
    assert_close(poptorch.inferenceModel(model, opts)(x), model(x))


# -- Precision: float32 inputs to a half model -------------------------------------------------
def test_half_model_takes_float32_inputs_like_poptorch():
    torch.manual_seed(0)
    model = TinyMLP().half()
    plain = copy.deepcopy(model)
    x, y = data(4)
    out = poptorch.inferenceModel(model)(x)  # float32 in: cast to the model's float16
    assert out.dtype == torch.float16
    assert_close(out, plain(x.half()))
    trained = copy.deepcopy(plain)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    wrapped = poptorch.trainingModel(trained, optimizer=optimizer)
    _, loss = wrapped(x, y)  # integer labels stay integers
    _, want = plain(x.half(), y)
    assert loss.dtype == torch.float16
    assert_close(loss, want.detach())
