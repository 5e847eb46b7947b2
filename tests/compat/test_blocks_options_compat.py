"""Issue 32, group 8: inline Blocks with automatic ids under AutoIncrement and their reported
placement; Options as PopTorch's options_test sets them (POPTORCH_DEFAULT_OPTIONS, PopART
options, option files overriding each other, copies with TensorLocations), running
statistics, and an offline target (compiles, refuses to run, its export loads and runs)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.reference import plain_train_call
from parallel.parallel_cases import assert_in_processes, cleaned, one_thread_everywhere


# --- inline Blocks, automatic ids, AutoIncrement -----------------------------------------
class ThreeInlineBlocks(nn.Module):
    """Blocks on ipus 0, 1, 0 named by Block.useAutoId() (PopTorch's example 3)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x, target):
        poptorch.Block.useAutoId()
        with poptorch.Block(ipu_id=0):
            x = torch.tanh(self.fc1(x))
        with poptorch.Block(ipu_id=1):
            x = torch.tanh(self.fc2(x))
        with poptorch.Block(ipu_id=0):
            out = self.fc3(x)
            loss = F.mse_loss(out, target)
        return out, loss


@pytest.mark.slow
def test_auto_ids_with_auto_increment_place_three_stages_on_ipus_0_1_0(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)
    D, G, B = 1, 5, 2  # pipelined training of 3 stages needs G >= 2*3-1
    model = ThreeInlineBlocks()
    plain = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(D).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(G)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    wrapped = cleaned(request, poptorch.trainingModel(
        model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for call in range(2):
        gen = torch.Generator().manual_seed(call)
        x, target = torch.randn(D * G * B, 4, generator=gen), torch.randn(D * G * B, 3, generator=gen)
        _, loss = wrapped(x, target)
        want = plain_train_call(plain, optimizer, x, target, D=D, G=G, R=1)
        assert_close(loss.as_subclass(torch.Tensor), torch.stack([l for *_, l in want]))
    placement = [(s.index, s.ipu_id, s.block_ids) for s in wrapped._compiled.stages]
    assert placement == [(0, 0, ("0",)), (1, 1, ("1",)), (2, 0, ("2",))]
    assert_in_processes(wrapped, 2)  # stages 0 and 2 share ipu 0's worker
    wrapped.copyWeightsToHost()
    for name, param in plain.named_parameters():
        assert_close(model.get_parameter(name), param, msg=name)


# --- POPTORCH_DEFAULT_OPTIONS as PopTorch's tests spell it --------------------------------
def _by_hand_block(o):
    o.deviceIterations(2).replicationFactor(1).enableSyntheticData(True)


@pytest.mark.parametrize("text, by_hand", [
    ('{"deviceIterations": 2, "replicationFactor": 1, "enableSyntheticData": true}',
     _by_hand_block),
    ('{"Precision.enableFloatingPointExceptions": true}',
     lambda o: o.Precision.enableFloatingPointExceptions(True)),
    ('{"connectionType": "ConnectionType.OnDemand"}',
     lambda o: o.connectionType(poptorch.ConnectionType.OnDemand)),
    ('{"_Popart.set": ["saveInitializersToFile", "my_file.onnx"]}',
     lambda o: o._Popart.set("saveInitializersToFile", "my_file.onnx")),
], ids=["block", "dotted", "enum-name", "popart"])
def test_default_options_from_the_environment(monkeypatch, text, by_hand):
    reference, opts = poptorch.Options(), poptorch.Options()
    by_hand(opts)
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", text)
    from_environment = poptorch.Options()
    assert str(from_environment) != str(reference)
    assert str(from_environment) == str(opts)


# --- PopART options -------------------------------------------------------------------------
POPART = {
    "hardwareInstrumentations": {0, 1},
    "dotChecks": ["FINAL", "ALL"],
    "engineOptions": {"debug.allowOutOfMemory": "true"},
    "reportOptions": {"reportOptA": "A", "reportOptB": "B"},
    "convolutionOptions": {"convOptA": "A"},
    "matmulOptions": {"matOptA": "A"},
    "lstmOptions": {"lstmOptA": "A"},
    "gclOptions": {"gclOptA": "A"},
    "customCodelets": [],
    "enableOutlining": True,
    "batchSerializationSettings.factor": 1,
    "batchSerializationSettings.concatOnVirtualGraphChange": True,
    "accumulateOuterFragmentSettings.schedule": 1,
    "accumulateOuterFragmentSettings.excludedVirtualGraphs": ["0", "1"],
    "enableExplicitIR": True,
    "automaticLossScalingSettings.gradientTensorTrackingMethod": 1,
}


def train_both(wrapped, plain: nn.Module, *, rows: int, inputs: int, outputs: int) -> None:
    """Three training calls of `wrapped` and three SGD steps (lr 0.1) of `plain` on the
    same random data."""
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        x, y = torch.randn(rows, inputs, generator=gen), torch.randn(rows, outputs, generator=gen)
        wrapped(x, y)
        optimizer.zero_grad()
        F.mse_loss(plain(x), y).backward()
        optimizer.step()


class WithLoss(nn.Module):
    """`inner`'s output and its MSE against `y`."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x, y):
        out = self.inner(x)
        return out, F.mse_loss(out, y)


def test_poptorchs_popart_options_are_kept_and_the_model_trains_like_torch():
    opts = poptorch.Options()
    for key, value in POPART.items():
        opts._Popart.set(key, value)
    opts._Popart.setPatterns({"PadSum": True}, 0)
    assert {k: opts._Popart.options[k] for k in POPART} == POPART
    assert opts.toDict()["_Popart"]["options"]["dotChecks"] == ["FINAL", "ALL"]
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    plain = copy.deepcopy(model)

    wrapped = poptorch.trainingModel(WithLoss(model), opts,
                                     torch.optim.SGD(model.parameters(), lr=0.1))
    train_both(wrapped, plain, rows=4, inputs=3, outputs=2)
    assert_close(model.weight, plain.weight)


def test_a_popart_option_of_an_unknown_value_type_gets_poptorchs_words():
    # PopTorch accepts it in set() and refuses it when the model compiles (issue 40)
    opts = poptorch.Options()
    opts._Popart.set("dotChecks", torch.empty(1, 1))
    with pytest.raises(poptorch.Error, match=r"Unknown value type Tensor for option dotChecks"):
        poptorch.inferenceModel(nn.Linear(2, 2), opts)


# --- option files ----------------------------------------------------------------------------
def test_a_second_options_file_overrides_only_what_it_sets(tmp_path):
    # PopTorch's test_override_options_from_file
    first, second = tmp_path / "tmp.conf", tmp_path / "tmp_override.conf"
    first.write_text("deviceIterations(2)\nsetExecutionStrategy(poptorch.ShardedExecution())\n"
                     "  replicationFactor(2)\n \nenableSyntheticData(True) # inline comment\n"
                     "# a comment\n")
    second.write_text("deviceIterations(1)\n")
    opts = poptorch.Options()
    opts.loadFromFile(str(first))
    opts.loadFromFile(str(second))

    class Add(nn.Module):
        def forward(self, x, y):
            return x + y

    wrapped = poptorch.inferenceModel(Add(), opts)
    assert wrapped.options.replication_factor == 2
    assert wrapped.options.device_iterations == 1
    assert isinstance(wrapped.options.execution_strategy, poptorch.ShardedExecution)


def test_deep_copied_options_keep_their_own_tensor_locations_and_popart_options():
    # PopTorch's test_copying_options, with its attribute names
    opts = poptorch.Options()
    on_chip = poptorch.TensorLocationSettings().useOnChipStorage(True)
    off_chip = poptorch.TensorLocationSettings().useOnChipStorage(False)
    opts.deviceIterations(5)
    opts.Distributed.configureProcessId(5, 15)
    opts.anchorTensor("t1", "tensor1", poptorch.OutputMode.EveryN, 2)
    opts._Popart.set("autoRecomputation", 3)
    opts._Popart.set("dummyKey", 5)
    opts.Training.gradientAccumulation(4)
    opts.TensorLocations.setWeightLocation(on_chip)
    deep_copy = copy.deepcopy(opts)

    opts.deviceIterations(4)
    opts.Distributed.configureProcessId(2, 15)
    opts.anchorTensor("t2", "tensor2", poptorch.OutputMode.Final)
    opts._Popart.set("autoRecomputation", 2)
    opts.TensorLocations.setWeightLocation(off_chip)

    assert opts.device_iterations != deep_copy.device_iterations
    assert opts.anchored_tensors != deep_copy.anchored_tensors
    for name in ("replication_factor", "log_dir", "auto_round_num_ipus", "output_mode",
                 "output_return_period", "connection_type", "sync_pattern",
                 "available_memory_proportion"):
        assert getattr(opts, name) == getattr(deep_copy, name), name
    assert opts.Distributed.distributed_process_id != deep_copy.Distributed.distributed_process_id
    assert deep_copy.Distributed.num_distributed_processes == 15
    assert deep_copy.TensorLocations.location_weight == {"onChip": True}
    assert opts.TensorLocations.location_weight == {"onChip": False}
    assert opts.TensorLocations.location_optimizer == {}
    assert deep_copy._Popart.options["autoRecomputation"] == 3
    assert opts._Popart.options["autoRecomputation"] == 2
    assert opts._Popart.options["dummyKey"] == deep_copy._Popart.options["dummyKey"] == 5
    assert opts.Training.gradient_accumulation == deep_copy.Training.gradient_accumulation


def test_every_tensor_location_setting_is_accepted_and_the_model_runs():
    # PopTorch's test_tensor_location
    opts = poptorch.Options()
    opts.TensorLocations.setActivationLocation(
        poptorch.TensorLocationSettings().minElementsForOffChip(4).useOnChipStorage(True))
    opts.TensorLocations.setWeightLocation(
        poptorch.TensorLocationSettings().useIOTilesToStore(True).useReplicatedTensorSharding(
            False))
    opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings().useIOTilesToLoad(False).useReplicatedTensorSharding(
            True).minElementsForReplicatedTensorSharding(4))
    opts.TensorLocations.setAccumulatorLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(False))
    assert opts.TensorLocations.location_optimizer == {
        "useIOTilesToLoad": False, "useReplicatedTensorSharding": True,
        "minElementsForReplicatedTensorSharding": 4}

    class Add(nn.Module):
        def forward(self, x, y):
            return x + y

    assert torch.equal(poptorch.inferenceModel(Add(), opts)(torch.ones(2), torch.zeros(2)),
                       torch.ones(2))


def test_training_and_inference_wrappers_leave_the_users_options_intact():
    # PopTorch's test_preserving_options_intact
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x, y):
            out = self.fc(x)
            return out, F.mse_loss(out, y)

    opts = poptorch.Options()
    model = WithLoss()
    training = poptorch.trainingModel(model, opts)
    inference = poptorch.inferenceModel(model, opts)
    assert opts.defaultOutputMode()
    assert training.options.output_mode == poptorch.OutputMode.Final
    assert inference.options.output_mode == poptorch.OutputMode.All


# --- running statistics -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float, torch.half], ids=["float", "half"])
def test_running_statistics_keep_the_models_dtype_and_torchs_values(dtype):
    # PopTorch's test_running_statistics: bn.running_var is in the model's dtype.
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("lin", nn.Linear(16, 16))
    model.add_module("bn", nn.BatchNorm1d(16))
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    model = model.to(dtype)
    plain = copy.deepcopy(model).eval()
    x = torch.randn(16, 16).to(dtype)
    out = poptorch.inferenceModel(model)(x)
    assert model.bn.running_var.dtype == dtype and out.dtype == dtype
    assert_close(out, plain(x))


def test_running_statistics_train_like_torch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    plain = copy.deepcopy(model)

    wrapped = poptorch.trainingModel(WithLoss(model),
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    train_both(wrapped, plain, rows=8, inputs=4, outputs=4)
    for name, value in plain.state_dict().items():
        assert_close(model.state_dict()[name], value, msg=name)


# --- an offline target --------------------------------------------------------------------------
class Add(nn.Module):
    def forward(self, x, y):
        return x + y


@pytest.mark.parametrize("offline", [
    lambda o: o.useOfflineIpuTarget(),
    lambda o: o.connectionType(poptorch.ConnectionType.Never),
], ids=["useOfflineIpuTarget", "ConnectionType.Never"])
def test_an_offline_model_compiles_but_running_it_raises(offline):
    # PopTorch's test_offline_ipu
    wrapped = poptorch.inferenceModel(Add(), offline(poptorch.Options()))
    x, y = torch.ones(2), torch.zeros(2)
    wrapped.compile(x, y)
    assert wrapped.isCompiled()
    with pytest.raises(AssertionError, match="Trying to run a model on an offline device"):
        wrapped(x, y)
    with pytest.raises(poptorch.Error, match="offline device"):
        wrapped(x, y)


def test_an_executable_compiled_offline_loads_and_runs(tmp_path):
    # PopTorch's test_offline_ipu_compileAndExport_file and test_precompile_then_load
    path = tmp_path / "model.poptorch"
    poptorch.inferenceModel(Add(), poptorch.Options().useOfflineIpuTarget()).compileAndExport(
        str(path), torch.ones(2), torch.zeros(2))
    loaded = poptorch.load(str(path))
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    assert torch.equal(loaded(x, y), torch.tensor([4.0, 6.0]))
    again = poptorch.load(str(path), edit_opts_fn=lambda o: o.useOfflineIpuTarget())
    with pytest.raises(AssertionError, match="offline device"):
        again(x, y)


# --- hardware queries without IPU hardware ---------------------------------------------------
def test_hardware_queries_say_there_is_no_ipu_as_poptorch_does_without_one():
    # PopTorch's tests guard hardware runs with ipuHardwareIsAvailable() and read the target
    # version with ipuHardwareVersion(), which asserts when there is no IPU.
    assert poptorch.ipuHardwareIsAvailable() is False
    assert poptorch.ipuHardwareIsAvailable(4) is False
    with pytest.raises(AssertionError, match="No IPU hardware available on this system"):
        poptorch.ipuHardwareVersion()
    with pytest.raises(poptorch.errors.IpuOnlyError):
        poptorch.ipuHardwareVersion()
    with pytest.raises(ValueError, match="num_ipus must be an int >= 1"):
        poptorch.ipuHardwareIsAvailable(0)


def test_cycle_count_without_ipu_hardware_after_a_logged_run():
    # PopTorch's test_log_cycle_count needs hardware; here the run works and cycleCount()
    # says by name that there are no IPU cycles to count.
    wrapped = poptorch.inferenceModel(Add(), poptorch.Options().logCycleCount(True))
    assert torch.equal(wrapped(torch.tensor([1]), torch.tensor([2])), torch.tensor([3]))
    with pytest.raises(poptorch.errors.IpuOnlyError, match=r"cycleCount\(\).*getComputeLatency"):
        wrapped.cycleCount()
    assert all(t >= 0 for t in wrapped.getComputeLatency())
