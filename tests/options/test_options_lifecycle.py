"""Freezing, clone / deepcopy / pickle, and toDict of Options."""
from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys

import pytest
import torch

from pipetorch.enums import OutputMode, ReductionType
from pipetorch.options import Options, TensorLocationSettings
from pipetorch.partition.strategies import ShardedExecution

FROZEN = "Can't modify frozen Options"


def configured() -> Options:
    opts = Options().deviceIterations(3).replicationFactor(2).outputMode(OutputMode.All)
    opts.Training.gradientAccumulation(4).accumulationAndReplicationReductionType(
        ReductionType.Sum)
    opts.TensorLocations.setOptimizerLocation(TensorLocationSettings().useOnChipStorage(False))
    opts.Precision.setPartialsType(torch.half)
    opts._Popart.set("key", [1, 2])
    return opts


@pytest.mark.parametrize("call, shown", [
    (lambda o: o.deviceIterations(2), "deviceIterations(2)"),
    (lambda o: o.outputMode(OutputMode.Sum), "outputMode(<OutputMode.Sum: 3>)"),
    (lambda o: o.randomSeed(1), "randomSeed(1)"),
    (lambda o: o.setExecutionStrategy(ShardedExecution()), "setExecutionStrategy("),
    (lambda o: o.setAvailableMemoryProportion({"IPU0": 0.2}),
     "setAvailableMemoryProportion({'IPU0': 0.2})"),
    (lambda o: o.anchorTensor("a", "b"), "anchorTensor('a', 'b')"),
    (lambda o: o.disableModuleNamescope(), "disableModuleNamescope()"),
    (lambda o: o.Training.gradientAccumulation(2), "Training.gradientAccumulation(2)"),
    (lambda o: o.Distributed.configureProcessId(0, 2), "Distributed.configureProcessId(0, 2)"),
    (lambda o: o.Distributed.disable(), "Distributed.disable()"),
    (lambda o: o.TensorLocations.setWeightLocation(TensorLocationSettings()),
     "TensorLocations.setWeightLocation("),
    (lambda o: o.Precision.enableStochasticRounding(True),
     "Precision.enableStochasticRounding(True)"),
    (lambda o: o.Jit.traceModel(False), "Jit.traceModel(False)"),
    (lambda o: o._Popart.set("k", 1), "_Popart.set('k', 1)"),
    (lambda o: o.loadFromFile("does-not-matter.txt"), "loadFromFile('does-not-matter.txt')"),
], ids=lambda c: "")
def test_frozen_options_refuse_every_setter(call, shown):
    opts = configured()
    opts._freeze(by="poptorch.trainingModel")
    assert opts._is_frozen and opts.Training._is_frozen and opts._Popart._is_frozen
    before = opts.toDict()
    # PopTorch's words first (scripts match them), then the call, what froze them, the fix.
    with pytest.raises(AttributeError, match=f"^{FROZEN}: ") as info:
        call(opts)
    assert f": {shown}" in str(info.value)
    assert "given to poptorch.trainingModel" in str(info.value)
    assert "opts = opts.clone()" in str(info.value)
    assert opts.toDict() == before


def test_frozen_seed_does_not_reseed_torch():
    opts = Options()
    opts._freeze()
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    with pytest.raises(AttributeError):
        opts.randomSeed(99)
    assert torch.equal(torch.rand(2), expected)


@pytest.mark.parametrize("make_copy", [lambda o: o.clone(), copy.deepcopy,
                                       lambda o: copy.deepcopy(o.clone())])
def test_copies_are_unfrozen_and_independent(make_copy):
    opts = configured()
    opts._freeze()
    twin = make_copy(opts)
    assert not twin._is_frozen and not twin.Training._is_frozen
    assert not twin._Popart._is_frozen and not twin.TensorLocations._is_frozen
    assert twin.toDict() == opts.toDict()
    twin.deviceIterations(7).Training.gradientAccumulation(9)
    twin._Popart.set("key", "changed")
    assert (opts.device_iterations, opts.Training.gradient_accumulation) == (3, 4)
    assert opts._Popart.options == {"key": [1, 2]}


def test_executor_style_clone_leaves_user_object_untouched():
    user = Options()
    internal = user.clone()
    internal.outputMode(OutputMode.Final)
    internal._freeze()
    assert user.output_mode == OutputMode.Default and not user._is_frozen


def test_pickle_round_trip_keeps_values_and_frozen_state():
    opts = configured()
    opts._freeze()
    restored = pickle.loads(pickle.dumps(opts))
    assert restored.toDict() == opts.toDict()
    assert restored._is_frozen
    with pytest.raises(AttributeError, match=FROZEN):
        restored.Training.gradientAccumulation(1)


def test_to_dict_holds_every_option_and_is_json_serialisable():
    opts = configured()
    out = opts.toDict()
    json.dumps(out)
    assert out["device_iterations"] == 3 and out["output_mode"] == OutputMode.All
    assert out["Training"]["gradient_accumulation"] == 4
    assert out["Training"]["accumulation_and_replication_reduction_type"] == ReductionType.Sum
    assert out["TensorLocations"]["optimizer_location"]["use_on_chip_storage"] is False
    assert out["Precision"]["partials_type"] == "torch.float16"
    assert out["Distributed"] == {"process_id": 0, "num_processes": 1, "env_var_names": None,
                                  "stages_across_processes": False}
    assert out["_Popart"] == {"options": {"key": [1, 2]}}
    assert out["execution_strategy"] == repr(opts.execution_strategy)
    expected_keys = set(Options._DEFAULTS) | set(Options._SUBGROUPS)
    assert set(out) == expected_keys


def test_repr_names_the_values():
    assert "device_iterations=3" in repr(configured())


def test_importing_options_does_not_import_the_partitioner():
    code = ("import sys, pipetorch.options as o; o.Options().deviceIterations(2); "
            "print(any(m.startswith('pipetorch.partition') for m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=60)
    assert result.stdout.strip() == "False"


def test_read_back_errors_are_not_reported_as_unknown_options(monkeypatch):
    # A getter's own AttributeError used to be swallowed by __getattr__ as "no option".
    def broken(*args):
        raise AttributeError("strategy construction failed")

    monkeypatch.setattr("pipetorch.partition.strategies.PipelinedExecution", broken)
    with pytest.raises(AttributeError, match="strategy construction failed"):
        Options().execution_strategy
