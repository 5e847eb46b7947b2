"""memory.json's figures: parameters, gradients, optimiser state and stashed activations."""
import time

import torch
import torch.nn as nn

import pipetorch as poptorch
from helpers.models import ReluStages
from pipetorch.planning.memory import optimiser_state_bytes
from pipetorch.profiling.recorder import Profiler


class NoBias(nn.Module):
    """out = x W^T (6 -> 8, no bias); loss = out.sum(). Autograd keeps x for W's gradient."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8, bias=False)

    def forward(self, x):
        out = self.fc(x)
        return out, poptorch.identity_loss(out, reduction="sum")


def local_profiler(tmp_path, *, optimizer, micro_batch=2, training=True):
    torch.manual_seed(0)
    model = NoBias()
    opts = poptorch.Options().showCompilationProgressBar(False).deviceIterations(2)
    wrapper = (poptorch.trainingModel(model, opts, optimizer=optimizer(model)) if training
               else poptorch.inferenceModel(model, opts))
    x = torch.randn(2 * micro_batch, 6)
    start = time.monotonic_ns()
    wrapper(x)
    end = time.monotonic_ns()
    profiler = Profiler(tmp_path, wrapper._compiled, training=training, options=wrapper.options,
                        sample=((x[:micro_batch].clone(),), {}))
    profiler.record_call(start, end, 2 * micro_batch)
    return profiler


def test_local_training_memory_from_tensor_sizes(tmp_path):
    profiler = local_profiler(tmp_path, optimizer=lambda m: torch.optim.Adam(m.parameters()))
    _, memory, _ = profiler.reports()
    assert memory["method"] == "computed from tensor sizes (no allocator statistics on the CPU)"
    (device,) = memory["devices"]
    weight = 6 * 8 * 4
    assert (device["parameters"], device["buffers"], device["gradients"]) == (weight, 0, weight)
    # Adam after a step: exp_avg and exp_avg_sq like the weight, plus its step counter.
    assert device["optimiser_state"] == 2 * weight + 4
    assert memory["optimiser_method"] == "state tensors"
    # One micro-batch of 2 keeps x (2x6) for W's gradient, the output (2x8) and the loss.
    assert device["activations_per_micro_batch"] == 2 * 6 * 4 + 2 * 8 * 4 + 4
    assert device["peak_stashed_micro_batches"] == 1
    assert device["activations"] == device["activations_per_micro_batch"]
    assert device["total"] == weight * 4 + 4 + device["activations"]
    assert device["measured_peak"] is None


def test_stashed_activations_grow_with_the_micro_batch(tmp_path):
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    small = local_profiler(tmp_path / "a", optimizer=sgd, micro_batch=2).reports()[1]
    large = local_profiler(tmp_path / "b", optimizer=sgd, micro_batch=5).reports()[1]
    assert large["devices"][0]["activations"] == 5 * (6 + 8) * 4 + 4
    assert small["devices"][0]["activations"] == 2 * (6 + 8) * 4 + 4
    assert small["devices"][0]["optimiser_state"] == 0  # SGD without momentum keeps nothing


def test_sizing_leaves_the_model_as_it_was(tmp_path):
    profiler = local_profiler(tmp_path, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    model = profiler.compiled.engine.model
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.eval()
    profiler.reports()
    assert not model.training  # the sizing forward runs in train mode, then restores eval
    for name, param in model.named_parameters():
        assert torch.equal(param, weights[name]) and torch.equal(param.grad, grads[name])


def test_inference_keeps_no_activations_and_no_gradients(tmp_path):
    profiler = local_profiler(tmp_path, optimizer=None, training=False)
    _, memory, _ = profiler.reports()
    (device,) = memory["devices"]
    assert (device["gradients"], device["optimiser_state"], device["activations"]) == (0, 0, 0)
    assert memory["activations_method"] == "inference keeps no activations for backward"


def test_optimiser_state_estimated_before_any_step():
    model = nn.Linear(4, 3)
    adam = torch.optim.Adam(model.parameters())
    params = list(model.parameters())
    state, how = optimiser_state_bytes(adam, params)
    assert how == "estimated from the state one step creates"
    assert state == 2 * (4 * 3 + 3) * 4 + 2 * 4  # two moments + one float32 step per tensor
    assert not adam.state  # the estimate stepped a copy, not this optimiser
    momentum = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    assert optimiser_state_bytes(momentum, params) == ((4 * 3 + 3) * 4,
                                                       "estimated from the state one step creates")
    assert optimiser_state_bytes(None, params) == (0, "no optimiser")


def test_on_a_gpu_the_local_engines_peak_is_measured(tmp_path, monkeypatch):
    # No GPU here: the allocator's answers are stubbed to check that its peak is reset when
    # profiling starts and reported in memory.json.
    from profiling_fakes import local_compiled, options

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls.append(("peak", d))
                        or 12345)
    compiled = local_compiled()
    compiled.engine.input_device = torch.device("cuda", 0)
    profiler = Profiler(tmp_path, compiled, training=True, options=options())
    assert calls == [("reset", torch.device("cuda", 0))]
    _, memory, _ = profiler.reports()
    assert memory["devices"][0]["measured_peak"] == 12345
    assert memory["method"].startswith("peak measured with torch.cuda.max_memory_allocated")


def staged_report(*, offload, recomputation, sharded=None):
    """memory.json of a two-stage pipelined engine built from a real split (no workers), and
    the compile-time estimate of the same configuration."""
    from types import SimpleNamespace

    from pipetorch.parallel.layout.compile_plan import CompilePlan
    from pipetorch.parallel.layout.placement import Placement
    from pipetorch.partition.split import split_stages
    from pipetorch.partition.strategies import StageSpec
    from pipetorch.planning.estimate import estimate_memory
    from pipetorch.profiling.memory import build
    from pipetorch.runtime.compile import Compiled
    from pipetorch.schedule.plans import Batching

    torch.manual_seed(0)
    model, x = ReluStages(), torch.randn(2, 6)
    stages = [StageSpec(0, 0, ("A",)), StageSpec(1, 1, ("B",))]
    adam = torch.optim.Adam(model.parameters())
    batching = Batching(1, 4, 1 if sharded is None else 2)
    engine = SimpleNamespace(
        model=model, optimizer=adam, batching=batching, schedule="pipelined",
        staged=split_stages(model, (x,), {}, stages), last_trace=[])
    plan = CompilePlan(tuple(stages), 2, "pipelined",
                       (Placement((0,), 0, "cpu", 1), Placement((1,), 1, "cpu", 1)))
    location = poptorch.TensorLocationSettings().useOnChipStorage(not offload)
    if sharded is not None:
        location.useReplicatedTensorSharding(True).minElementsForReplicatedTensorSharding(sharded)
    options = SimpleNamespace(TensorLocations=SimpleNamespace(optimizer_location=location),
                              Training=SimpleNamespace(recomputation=recomputation))
    report = build(Compiled(engine, plan, None, 0.1), training=True, options=options,
                   sample=((x,), {}))
    estimate = estimate_memory(model, ((x,), {}), stages, batching=batching, optimizer=adam,
                               pipelined=True, training=True, offload=offload,
                               recomputation=recomputation, sharding=sharded)
    return report, estimate


def test_offloaded_optimiser_state_is_shown_on_the_host():
    report, estimate = staged_report(offload=True, recomputation=False)
    stage0 = report["devices"][0]
    weight = 6 * 8 * 4
    assert (stage0["optimiser_state"], stage0["host_optimiser_state"]) == (0, 2 * weight + 4)
    assert stage0["optimiser_location"] == "host"
    assert "host memory" in report["optimiser_note"]
    assert [d["total"] for d in report["devices"]] == [d.total for d in estimate.devices.values()]


def test_recomputation_shrinks_the_reported_stash():
    plain, _ = staged_report(offload=False, recomputation=False)
    recomputed, estimate = staged_report(offload=False, recomputation=True)
    x, h = 2 * 6 * 4, 2 * 8 * 4
    # 1F1B: stage 0 stashes 2 micro-batches of x, relu's result and h; recomputing, x and h,
    # with relu's result back for one micro-batch during its backward.
    assert plain["devices"][0]["activations"] == 2 * (x + h + h)
    assert recomputed["devices"][0]["activations"] == 2 * (x + h) + h
    assert recomputed["devices"][0]["recomputation"] is True
    assert "with recomputation" in recomputed["activations_method"]
    assert [d["total"] for d in recomputed["devices"]] == [
        d.total for d in estimate.devices.values()]


def test_sharded_optimiser_state_is_reported_as_the_estimate_prices_it():
    # memory.json counted a whole copy of the optimiser state on every replica with
    # useReplicatedTensorSharding(True): it keeps 1/R of each weight's over the threshold
    report, estimate = staged_report(offload=False, recomputation=False, sharded=40)
    # Adam: two float32 moments an element, a step count a tensor; fc1 (48 elements) sharded
    # over the 2 replicas, fc2 (32) whole
    assert [d["optimiser_state"] for d in report["devices"]] == [(48 * 8 + 4) // 2, 32 * 8 + 4]
    assert [d["optimiser_state"] for d in report["devices"]] == [
        d.optimiser_state for d in estimate.devices.values()]
    assert [d["total"] for d in report["devices"]] == [d.total for d in estimate.devices.values()]
