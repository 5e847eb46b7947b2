"""Options.loadFromFile: lines applied as setters, parsed safely, bad lines named by number."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pipetorch.enums import OutputMode, ReductionType
from pipetorch.errors import ConfigError
from pipetorch.options import Options
from pipetorch.partition.strategies import ShardedExecution

GOOD = """\
# batching
deviceIterations(4)

Training.gradientAccumulation(2).accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)
outputMode(poptorch.OutputMode.EveryN, output_return_period=2)
setAvailableMemoryProportion({"IPU0": 0.25})
TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
Precision.setPartialsType(torch.float16)
setExecutionStrategy(pipetorch.ShardedExecution(poptorch.Stage("A"), poptorch.Stage("B").ipu(1)))
_Popart.set("someOption", -3)
   logDir("logs")   
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "opts.cfg"
    path.write_text(text)
    return path


def test_good_file_sets_every_line(tmp_path):
    opts = Options()
    assert opts.loadFromFile(write(tmp_path, GOOD)) is opts
    assert opts.device_iterations == 4
    assert opts.Training.gradient_accumulation == 2
    assert opts.Training.accumulation_and_replication_reduction_type == ReductionType.Sum
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.EveryN, 2)
    assert opts.available_memory_proportion == {"IPU0": 0.25}
    assert opts.TensorLocations.optimizer_location.use_on_chip_storage is False
    assert opts.Precision.partials_type == torch.float16
    assert isinstance(opts.execution_strategy, ShardedExecution)
    assert opts._Popart.options == {"someOption": -3}
    assert opts.log_dir == "logs"


@pytest.mark.parametrize("line, reason", [
    ("deviceIteration(4)", "Options has no option 'deviceIteration'; valid: "),
    ("Training.gradAccum(2)", "Training has no option 'gradAccum'; valid: "),
    ("deviceIterations(0)", "deviceIterations: device_iterations must be an int >= 1; got 0"),
    ("deviceIterations('4')", "must be an int >= 1; got '4' (str)"),
    ("deviceIterations", "a line must call a setter"),
    ("deviceIterations(4) + 1", "a line must call a setter"),
    ("deviceIterations(__import__('os').getpid())", "unknown name '__import__'"),
    ("deviceIterations(os.getpid())", "unknown name 'os'"),
    ("logDir(poptorch.options.environment.os.getcwd())", "may not be called"),
    ("deviceIterations(torch.manual_seed(0))", "only dtypes (torch.float16, ...) may be used"),
    ("deviceIterations(poptorch._LAZY)", "private name '_LAZY' is not allowed"),
    ("deviceIterations(*[4])", "is not allowed: use literals, attribute chains and calls only"),
    ("deviceIterations(x=4)", "unexpected keyword argument 'x'"),
    ("deviceIterations(poptorch.NoSuchThing)", "has no attribute 'NoSuchThing'"),
    ("Training(2)", "may not be called"),
])
def test_bad_line_names_file_and_line(tmp_path, line, reason):
    path = write(tmp_path, f"# header\nreplicationFactor(2)\n\n{line}\n")
    opts = Options()
    with pytest.raises(ConfigError, match=re.escape(f"{path}, line 4: {line!r}: ") + ".*"
                       + re.escape(reason)):
        opts.loadFromFile(path)


def test_syntax_error_is_reported_before_anything_changes(tmp_path):
    path = write(tmp_path, "deviceIterations(4)\nreplicationFactor(2\n")
    opts = Options()
    with pytest.raises(ConfigError, match=re.escape(f"{path}, line 2: 'replicationFactor(2'"
                                                     " is not a valid option line")):
        opts.loadFromFile(path)
    assert opts.device_iterations == 1


def test_missing_file_raises_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        Options().loadFromFile(tmp_path / "absent.cfg")
