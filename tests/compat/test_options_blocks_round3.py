"""Issue 40: option validation in PopTorch's words (unknown PopART names and value types,
checked when a model compiles or by poptorch_core._validateOptions; Options.set), the
execution strategy read back as `_execution_strategy`, removeBlocks, BeginBlock on a plain
function, and what pipetorch saves for the user loading with torch.load's defaults."""
import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch
from pipetorch.options.popart_names import SESSION_OPTIONS


# --- option validation ---------------------------------------------------------------------
@pytest.mark.parametrize("key, value, message", [
    ("asdfasdf", True, r"^Unknown bool option asdfasdf: it is not one of PopART's"),
    ("enableOutlinning", 3, r"^Unknown uint64 option enableOutlinning: .*did you mean "
                            r"enableOutlining"),
    ("dotChecks", torch.empty(1, 1), r"^Unknown value type Tensor for option dotChecks: "),
    ("engineOptions", {"a": object()}, r"^Unknown value type dict for option engineOptions"),
])
def test_popart_options_are_checked_when_the_model_compiles(key, value, message):
    # PopTorch's test_invalid_options: accepted by set(), refused by _validateOptions
    opts = poptorch.Options()
    opts._Popart.set(key, value)
    with pytest.raises(poptorch.Error, match=message):
        poptorch.poptorch_core._validateOptions(opts.toDict())
    with pytest.raises(poptorch.Error, match=message):
        poptorch.inferenceModel(nn.Linear(2, 2), opts)


def test_popart_session_option_names_are_popart_s():
    for name in ("enableOutlining", "batchSerializationSettings.factor", "dotChecks",
                 "automaticLossScalingSettings.gradientTensorTrackingMethod", "matmulOptions",
                 "accumulateOuterFragmentSettings.excludedVirtualGraphs", "enableExplicitIR"):
        assert name in SESSION_OPTIONS
    opts = poptorch.Options()
    opts._Popart.set("enableOutlining", True)
    opts._Popart.set("hardwareInstrumentations", {0, 1})
    opts._Popart.setPatterns({"PadSum": True}, 0)
    poptorch.poptorch_core._validateOptions(opts.toDict())


def test_options_set_refuses_unknown_names_and_types():
    opts = poptorch.Options()
    assert opts.set(random_seed=42).random_seed == 42
    with pytest.raises(poptorch.Error, match="^Unknown option asdf: "):
        opts.set(asdf=1)
    with pytest.raises(poptorch.Error, match="^Unknown value type str for option random_seed"):
        opts.set(random_seed="42")
    with pytest.raises(poptorch.Error, match="^Unknown option asdf: "):
        poptorch.poptorch_core._validateOptions({**opts.toDict(), "asdf": 1})


def test_the_execution_strategy_reads_back_by_poptorchs_name():
    opts = poptorch.Options()
    assert isinstance(opts._execution_strategy, poptorch.PipelinedExecution)
    sharded = poptorch.ShardedExecution()
    assert opts.setExecutionStrategy(sharded)._execution_strategy is sharded


# --- blocks --------------------------------------------------------------------------------
class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def test_remove_blocks_runs_the_model_as_one_block():
    model = TwoBlocks()
    poptorch.BeginBlock(model.second, ipu_id=1)
    with pytest.raises(poptorch.Error, match="module has already been assigned to a block"):
        poptorch.BeginBlock(model.second, ipu_id=1)
    poptorch.removeBlocks(model)
    x = torch.randn(4, 3)
    wrapper = poptorch.inferenceModel(model)
    assert_close(wrapper(x), model(x))
    assert wrapper._compiled.devices == 1
    poptorch.BeginBlock(model.second, ipu_id=1)  # may begin a block again


def add_one(x):
    return x + 1.0


def test_begin_block_on_a_function_keeps_poptorchs_attributes_and_saves():
    block = poptorch.BeginBlock(add_one, 1, 2)
    assert (block._user_id, block._ipu_id) == (1, 2)
    assert_close(block(torch.ones(2)), torch.full((2,), 2.0))
    saved = io.BytesIO()
    torch.save(block, saved)
    saved.seek(0)
    assert_close(torch.load(saved, weights_only=False)(torch.ones(2)), torch.full((2,), 2.0))


def test_a_begin_block_module_prints_and_saves_as_the_module_it_wraps():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    poptorch.BeginBlock(model, user_id=1, ipu_id=2)
    assert repr(model).startswith("Sequential(")
    assert poptorch.module_repr(model).startswith("BeginBlock(user_id=1, ipu_id=2) Sequential(")
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert type(loaded) is nn.Sequential
    assert poptorch.module_repr(loaded).startswith("BeginBlock(user_id=1, ipu_id=2) Sequential(")


# --- checkpoints ---------------------------------------------------------------------------
class WithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = TwoBlocks()

    def forward(self, x, y):
        out = self.inner(x)
        return out, F.mse_loss(out, y)


def _saved_and_loaded(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # torch's default: weights_only=True


@pytest.mark.parametrize("cls", [poptorch.optim.SGD, poptorch.optim.Adam])
def test_what_pipetorch_saves_loads_with_torch_load_defaults(cls):
    # since torch 2.6 torch.load refuses anything but tensors and plain containers by default
    model = WithLoss()
    optimizer = cls(model.parameters(), lr=0.01)
    wrapper = poptorch.trainingModel(model, optimizer=optimizer)
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    wrapper(x, y)
    params = optimizer.state_dict()
    name = "scaledLearningRate0" if cls is poptorch.optim.SGD else "learningRate"
    params["ipu_param"][f"{name}___specific___model.inner.first.bias"] = torch.tensor(0.5)
    optimizer.load_state_dict(params)  # a parameter's own value is saved with the state
    checkpoint = {"model": wrapper.state_dict(), "optimizer": optimizer.state_dict()}
    loaded = _saved_and_loaded(checkpoint)
    again = WithLoss()
    again.load_state_dict(loaded["model"])
    for name, param in model.named_parameters():
        assert_close(again.get_parameter(name), param)
    restored = cls(again.parameters(), lr=0.01)
    restored.load_state_dict(loaded["optimizer"])
    twin = poptorch.trainingModel(again, optimizer=restored)
    assert_close(twin(x, y)[1], wrapper(x, y)[1])
    assert_close(copy.deepcopy(twin.model.inner.first.bias), model.inner.first.bias)


# --- logging -------------------------------------------------------------------------------
def test_set_log_level_prints_even_when_the_root_only_collects_records(capfd):
    # pytest's record-collecting root handler kept pipetorch from printing the log lines
    # PopTorch's tests read from stderr (its logger always prints)
    import logging
    poptorch.setLogLevel("DEBUG")
    try:
        logging.getLogger("pipetorch.test_round3").debug("issue 40 line")
        assert "[debug] issue 40 line" in capfd.readouterr().err  # PopTorch: lower case
    finally:
        poptorch.setLogLevel("WARN")
