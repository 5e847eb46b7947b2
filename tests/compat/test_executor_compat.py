"""Issue 17 group 4: the PoplarExecutor API as PopTorch documents it (compilationTime, saved
executables, rng_state, perf counters, isinstance, destroy, re-wrapping)."""
import copy
import datetime
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch
from pipetorch.partition.cache import read_checked, write_checked
from pipetorch.runtime.artefact import MAGIC, ExecutableError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Net(nn.Module):
    """One device: dropout between two layers, the loss last."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)
        self.drop = nn.Dropout(p)
        self.note = "kept"

    def forward(self, x, y=None):
        return self.head(self.drop(torch.relu(self.a(x))), y)

    def head(self, h, y):
        out = self.b(h)
        return out if y is None else (out, F.cross_entropy(out, y))


class Blocks(Net):
    """The same on two devices: blocks B1 and B2."""

    def forward(self, x, y=None):
        with poptorch.Block("B1", ipu_id=0):
            h = self.drop(torch.relu(self.a(x)))
        with poptorch.Block("B2", ipu_id=1):
            return self.head(h, y)


def _sharded():
    opts = poptorch.Options()
    opts.setExecutionStrategy(poptorch.ShardedExecution("B1", "B2"))
    return opts


@pytest.fixture
def local(monkeypatch):
    """Every stage in this process: the stages are checked, no worker starts."""
    monkeypatch.setenv("PIPETORCH_EXECUTION", "local")


def test_compilation_time_is_a_timedelta_after_compiling():
    wrapped = poptorch.inferenceModel(Net())
    with pytest.raises(RuntimeError, match="compilationTime.*call the model or compile"):
        wrapped.compilationTime()
    wrapped.compile(torch.randn(2, 4))
    assert isinstance(wrapped.compilationTime(), datetime.timedelta)
    assert wrapped.compilationTime().total_seconds() > 0


def test_wrapper_is_an_instance_of_the_model_class_and_forwards_attributes():
    model = Net()
    wrapped = poptorch.inferenceModel(model)
    assert isinstance(wrapped, Net) and isinstance(wrapped, poptorch.PoplarExecutor)
    assert isinstance(wrapped, nn.Module)
    assert wrapped.note == "kept" and wrapped.a is model.a
    assert repr(wrapped).startswith("inferenceModel(Net(")


def test_destroy_is_reachable_from_the_model_and_rewrapping_works():
    model = Net()
    training = poptorch.trainingModel(model)
    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    training(x, y)
    with pytest.raises(poptorch.Error, match=r"already been wrapped.*Call model.destroy\(\)"):
        poptorch.trainingModel(model)
    # An inference wrapper of the training wrapper runs the trained model.
    inference = poptorch.inferenceModel(training)
    assert inference.model is model
    assert_close(inference(x), model(x))
    model.destroy()  # as PopTorch: destroys the model's wrappers
    assert not training.isCompiled() and not inference.isCompiled()
    assert "destroy" not in vars(model)  # no wrapper left: the model is plain again
    again = poptorch.trainingModel(model)
    again(x, y)
    again.destroy()


def test_perf_counters_and_latency_come_from_the_last_call():
    opts = poptorch.Options().deviceIterations(3)
    wrapped = poptorch.inferenceModel(Net(), opts)
    assert wrapped.getPerfCounters()["input"] == [[]]  # as PopTorch before the first call
    assert wrapped.getLatency() == (0.0, 0.0, 0.0)
    wrapped(torch.randn(6, 4))
    counters = wrapped.getPerfCounters()
    assert sorted(counters) == ["input", "input_complete", "output", "output_complete"]
    assert len(counters["input"]) == 1 and len(counters["input"][0]) == 3  # 1 input, 3 iterations
    assert len(counters["output"]) == 1
    first = [counters[e][0][0] for e in ("input", "input_complete", "output", "output_complete")]
    assert first == sorted(first)
    low, high, mean = wrapped.getLatency()
    assert 0 < low <= mean <= high
    assert low == pytest.approx(first[3] - first[0])
    parts = [wrapped.getHostIpuLatency()[0], wrapped.getComputeLatency()[0],
             wrapped.getIpuHostLatency()[0]]
    assert all(p >= 0 for p in parts) and sum(parts) == pytest.approx(low)


def test_rng_state_repeats_dropout():
    torch.manual_seed(0)
    model = Net(p=0.5)
    # lr 0: the weights stay, so only dropout's masks change the outputs between calls.
    training = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(
        model.parameters(), lr=0.0))
    with pytest.raises(RuntimeError, match="rng_state needs a compiled model"):
        training.rng_state
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    training(x, y)
    state = training.rng_state
    first = training(x, y)[0]
    second = training(x, y)[0]
    assert not torch.equal(first, second)  # dropout draws new masks
    training.rng_state = state
    assert torch.equal(training(x, y)[0], first)
    with pytest.raises(ValueError, match="rng_state got 2 states"):
        training.rng_state = state * 2
    training.destroy()


def test_saved_executable_runs_like_the_model(local, tmp_path):
    torch.manual_seed(1)
    model = Blocks()
    x = torch.randn(2, 4)
    wrapped = poptorch.inferenceModel(model, _sharded())
    wrapped.compileAndExport(str(tmp_path / "model.pex"), x)
    expected = model(x)
    loaded = poptorch.load(str(tmp_path / "model.pex"))
    assert_close(loaded(x), expected)
    assert loaded.options.execution_strategy is not None
    wrapped.save(str(tmp_path / "again.pex"))
    assert_close(poptorch.load(str(tmp_path / "again.pex"))(x), expected)
    wrapped.save(str(tmp_path))  # a folder: saved as model.poptorch in it, as PopTorch does
    assert_close(poptorch.load(str(tmp_path / "model.poptorch"))(x), expected)


def test_saved_training_executable_keeps_training_like_torch(local, tmp_path):
    torch.manual_seed(2)
    model = Blocks()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 1])
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrapped = poptorch.trainingModel(model, _sharded(), optimizer=opt)
    wrapped(x, y)
    wrapped.save(str(tmp_path / "train.pex"))
    wrapped.destroy()

    loaded = poptorch.load(str(tmp_path / "train.pex"))
    assert loaded.training
    loaded(x, y)
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        plain_opt.zero_grad()
        reference(x, y)[1].backward()
        plain_opt.step()
    saved = dict(loaded.model.net.named_parameters())
    for name, param in reference.named_parameters():
        assert_close(saved[name], param, msg=name)

    # loadExecutable compiles a wrapper of the same class for the saved inputs, keeping the
    # wrapper's own weights (PopTorch's rule; poptorch.load restores the saved ones).
    other = Blocks()
    own = copy.deepcopy(other.state_dict())
    expected = copy.deepcopy(other).eval()(x, y)[0].detach()
    fresh = poptorch.inferenceModel(other, _sharded())
    fresh.loadExecutable(str(tmp_path / "train.pex"))  # compiled for (x, y)'s shapes
    assert fresh.isCompiled()
    assert_close(fresh(x, y)[0], expected)
    for name, value in other.state_dict().items():
        assert_close(value, own[name], msg=name)
    with pytest.raises(poptorch.Error, match="saved from another model"):
        poptorch.inferenceModel(nn.Linear(2, 2)).loadExecutable(str(tmp_path / "train.pex"))


def test_a_saved_executable_of_another_version_is_refused(tmp_path):
    path = tmp_path / "model.pex"
    wrapped = poptorch.inferenceModel(Net())
    wrapped.compileAndExport(str(path), torch.randn(2, 4))
    header, payload = read_checked(path, MAGIC, "an executable")
    write_checked(path, MAGIC, {**header, "torch": "1.0.0"}, payload)
    with pytest.raises(ExecutableError, match=r"saved by pipetorch .* with torch 1\.0\.0.*"
                                              r"export it again"):
        poptorch.load(str(path))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ExecutableError, match="do not match their checksum"):
        poptorch.load(str(path))


_USER_MODEL = '''
import torch, torch.nn as nn, torch.nn.functional as F
import pipetorch as poptorch

class UserNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x, y):
        with poptorch.Block("B1", ipu_id=0):
            h = torch.tanh(self.a(x))
        with poptorch.Block("B2", ipu_id=1):
            out = self.b(h)
            return out, F.cross_entropy(out, y)
'''

_LOADER = '''
import sys, torch
import pipetorch as poptorch
try:
    import usernet
    sys.exit("the model's source must not be importable here")
except ImportError:
    pass
data = torch.load(sys.argv[2])
loaded = poptorch.load(sys.argv[1])
out, loss = loaded(data["x"], data["y"])
weights = {n: p.detach() for n, p in loaded.model.net.named_parameters()}
loaded.destroy()
torch.save({"out": out.as_subclass(torch.Tensor), "loss": loss.as_subclass(torch.Tensor),
            "weights": weights}, sys.argv[3])
'''


@pytest.mark.slow
def test_a_fresh_process_without_the_source_loads_and_trains(tmp_path, monkeypatch):
    source = tmp_path / "src"
    source.mkdir()
    (source / "usernet.py").write_text(textwrap.dedent(_USER_MODEL))
    monkeypatch.syspath_prepend(str(source))
    import usernet

    torch.manual_seed(3)
    model = usernet.UserNet()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 1])
    opts = _sharded()
    wrapped = poptorch.trainingModel(model, opts, optimizer=poptorch.optim.Adam(
        model.parameters(), lr=0.01))
    wrapped.compileAndExport(str(tmp_path / "user.pex"), x, y)
    wrapped.destroy()
    torch.save({"x": x, "y": y}, tmp_path / "data.pt")
    env = {k: v for k, v in os.environ.items() if k != "PIPETORCH_EXECUTION"}
    env["PYTHONPATH"] = ROOT  # pipetorch only, not the model's folder
    done = subprocess.run([sys.executable, "-c", _LOADER, str(tmp_path / "user.pex"),
                           str(tmp_path / "data.pt"), str(tmp_path / "result.pt")],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(tmp_path / "result.pt")

    plain_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    out, loss = reference(x, y)
    loss.backward()
    plain_opt.step()
    assert_close(result["out"], out.detach())
    assert_close(result["loss"], loss.detach())
    for name, param in reference.named_parameters():
        assert_close(result["weights"][name], param, msg=name)


@pytest.mark.slow
def test_stage_workers_repeat_dropout_and_take_a_written_optimizer_state():
    torch.manual_seed(4)
    model = Blocks(p=0.5)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)  # lr 0: weights stay
    wrapped = poptorch.trainingModel(model, _sharded(), optimizer=opt)
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    try:
        wrapped(x, y)
        state = wrapped.rng_state
        assert len(state) == 2  # one per stage worker
        first = wrapped(x, y)[0]
        assert not torch.equal(wrapped(x, y)[0], first)
        wrapped.rng_state = state
        assert torch.equal(wrapped(x, y)[0], first)

        # A velocity written after compiling reaches the workers: the next step (lr 0.1,
        # same dropout masks) matches torch's SGD started from that velocity.
        reference = copy.deepcopy(model)
        velocity = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}
        opt.write_ipu_state({f"Accl___{n}": v for n, v in velocity.items()})
        wrapped.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        rng = wrapped.rng_state
        wrapped(x, y)
    finally:
        wrapped.destroy()
    torch.random.set_rng_state(rng[0][0])  # stage 0 draws the dropout mask
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for name, param in reference.named_parameters():
        plain_opt.state[param]["momentum_buffer"] = velocity[name].clone()
    reference(x, y)[1].backward()
    plain_opt.step()
    for name, param in reference.named_parameters():
        assert_close(model.get_parameter(name), param, msg=name)
