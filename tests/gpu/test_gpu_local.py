"""One device on a GPU, in this process: device choice, placement, transport pieces, precision,
the RNG, memory figures; each against plain PyTorch or the allocator on the same GPU."""
import copy
import json
import logging

import pytest
import torch
import torch.nn as nn

import pipetorch as poptorch
from gpu_cases import CUDA, GPU_TOLERANCE, assert_same_weights, gpus, on_gpu, plain_steps
from helpers.models import MnistNetwork, TinyMLP, WithLoss, data, mnist_data
from pipetorch.errors import OutOfMemoryError
from pipetorch.optim import scaling
from pipetorch.parallel.layout import placement
from pipetorch.parallel.layout.routes import TensorSpec
from pipetorch.parallel.comm.transport import BundleLayout, backend_for
from pipetorch.partition.strategies import StageSpec
from pipetorch.planning.estimate import device_budget
from pipetorch.partition.probe import preserved
from pipetorch.parallel.layout.placement import default_device

pytestmark = CUDA

D, G, B = 2, 3, 4


def options(*, D=D, G=G, als=False):
    opts = poptorch.Options().deviceIterations(D).showCompilationProgressBar(False)
    opts.outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(G)
    opts.Training.setAutomaticLossScaling(als)
    return opts


def test_the_default_device_is_the_first_gpu(monkeypatch):
    monkeypatch.delenv("PIPETORCH_DEVICE", raising=False)
    assert default_device() == torch.device("cuda")
    last = f"cuda:{gpus() - 1}"
    monkeypatch.setenv("PIPETORCH_DEVICE", last)
    assert default_device() == torch.device(last)


def test_logical_devices_take_the_gpus_replica_major(monkeypatch, caplog):
    on_gpu(monkeypatch)
    count = gpus()
    assert placement.physical().devices == tuple(f"cuda:{i}" for i in range(count))
    stages = [StageSpec(0, 0, ("A",)), StageSpec(1, 1, ("B",))]
    placed = placement.place(stages, replicas=2)
    assert [(p.stages, p.replica, p.device) for p in placed] == [
        ((0,), 0, f"cuda:{0 % count}"), ((1,), 0, f"cuda:{1 % count}"),
        ((0,), 1, f"cuda:{2 % count}"), ((1,), 1, f"cuda:{3 % count}")]
    # stages on ipus 0, 1, 0: one worker (one GPU) per logical device
    interleaved = [StageSpec(0, 0, ("A",)), StageSpec(1, 1, ("B",)), StageSpec(2, 0, ("C",))]
    assert [(p.stages, p.device) for p in placement.place(interleaved)] == [
        ((0, 2), "cuda:0"), ((1,), f"cuda:{1 % count}")]
    on_gpu(monkeypatch, gpus=1)
    with caplog.at_level(logging.WARNING, logger=placement.__name__):
        placed = placement.place(stages, replicas=2)
    assert {p.device for p in placed} == {"cuda:0"}
    assert "4 logical devices (2 per replica x 2 replicas) share 1 GPU(s)" in caplog.text


def test_stages_sharing_a_gpu_use_gloo_through_host_memory():
    assert backend_for([torch.device("cuda", 0)] * 2) == ("gloo", True)
    if gpus() >= 2 and torch.distributed.is_nccl_available():
        assert backend_for([torch.device("cuda", 0), torch.device("cuda", 1)]) == ("nccl", False)


def test_a_bundle_staged_through_host_memory_arrives_unchanged():
    # What PeerLink does when stages share a GPU: pack on the GPU's side into a host buffer,
    # send that, and copy the received bytes back onto the GPU.
    tensors = [torch.randn(3, 5, device="cuda"), torch.arange(7, device="cuda"),
               torch.randn(2, dtype=torch.float16, device="cuda").expand(4, 2)]
    layout = BundleLayout(tuple(TensorSpec(tuple(t.shape), t.dtype, False) for t in tensors))
    buffer = layout.pack(tensors, torch.device("cpu"))
    assert buffer.device.type == "cpu"
    arrived = layout.unpack(buffer.to("cuda", non_blocking=True))
    for got, want in zip(arrived, tensors, strict=True):
        assert got.device.type == "cuda"
        assert torch.equal(got, want)


def test_the_budget_defaults_to_the_gpus_memory():
    device = torch.device("cuda", 0)
    assert device_budget(None, device=device) == torch.cuda.mem_get_info(device)[1]


def test_the_shape_probe_leaves_the_gpus_random_numbers_as_they_were():
    torch.cuda.init()
    model = nn.Dropout(0.5).cuda()
    before = torch.cuda.get_rng_state_all()
    with preserved(model):
        model(torch.ones(64, device="cuda"))  # dropout draws from the GPU's generator
    assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), before))


def mnist_pair():
    torch.manual_seed(0)
    model = WithLoss(MnistNetwork())
    return model, copy.deepcopy(model).cuda()


def one_device(opts):
    """Seed 000's four blocks together on ipu 0."""
    return opts.setExecutionStrategy(poptorch.ShardedExecution(
        poptorch.Stage("B1", "B2", "B3", "B4").ipu(0)))


def test_one_device_on_a_gpu_trains_like_plain_pytorch_on_it(monkeypatch):
    on_gpu(monkeypatch)
    model, plain = mnist_pair()
    wrapped = poptorch.trainingModel(model, one_device(options()), optimizer=torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9))
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    for seed in range(2):
        x, y = mnist_data(D * G * B, seed=seed)
        _, losses = wrapped(x, y)
        assert wrapped._compiled.engine.input_device.type == "cuda"
        want = plain_steps(plain, plain_optimizer, x, y, D=D, G=G)
        torch.testing.assert_close(losses.cpu(), want, **GPU_TOLERANCE)
    wrapped.copyWeightsToHost()
    assert_same_weights(model, plain, **GPU_TOLERANCE)
    wrapped.destroy()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["16.16", "bf16"])
def test_half_precision_on_a_gpu_trains_like_plain_pytorch_on_it(monkeypatch, dtype):
    on_gpu(monkeypatch)
    torch.manual_seed(0)
    model = TinyMLP().to(dtype)
    plain = copy.deepcopy(model).cuda()
    scale = 256 if dtype == torch.float16 else None
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=scale)
    plain_optimizer = poptorch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9,
                                         loss_scaling=scale)
    wrapped = poptorch.trainingModel(model, options(), optimizer=optimizer)
    x, y = data(D * G * B)
    _, losses = wrapped(x.to(dtype), y)
    want = plain_steps(plain, plain_optimizer, x.to(dtype), y, D=D, G=G)
    torch.testing.assert_close(losses.cpu(), want)  # same kernels on the same GPU
    wrapped.copyWeightsToHost()
    assert_same_weights(model, plain)
    wrapped.destroy()


def test_automatic_loss_scaling_on_a_gpu_skips_the_overflowing_step(monkeypatch):
    on_gpu(monkeypatch)
    torch.manual_seed(0)
    model = TinyMLP().half()
    plain = copy.deepcopy(model).cuda()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.2, loss_scaling=1024)
    plain_optimizer = poptorch.optim.SGD(plain.parameters(), lr=0.2, loss_scaling=1024)
    scaling.enable_automatic_loss_scaling(plain_optimizer)
    wrapped = poptorch.trainingModel(model, options(D=1, als=True), optimizer=optimizer)
    x, y = data(G * B)
    x[0] = 60000.0  # its gradients times the scale overflow float16
    wrapped(x.half(), y)
    plain_steps(plain, plain_optimizer, x.half(), y, D=1, G=G)
    device_optimizer = wrapped._compiled.engine.optimizer
    assert scaling.skipped_steps(device_optimizer) == 1
    assert scaling.loss_scale(device_optimizer) == 512
    assert scaling.scaling_state(device_optimizer) == scaling.scaling_state(plain_optimizer)
    wrapped.copyWeightsToHost()
    assert_same_weights(model, plain)
    wrapped.destroy()


def test_the_memory_report_holds_the_allocators_peak_on_the_gpu(monkeypatch, tmp_path):
    on_gpu(monkeypatch)
    model, _ = mnist_pair()
    wrapped = poptorch.trainingModel(model, one_device(options()).enableProfiling(str(tmp_path)),
                                     optimizer=torch.optim.Adam(model.parameters()))
    wrapped(*mnist_data(D * G * B, seed=0))
    highest = torch.cuda.max_memory_allocated(torch.device("cuda", 0))
    wrapped.destroy()
    report = json.loads((tmp_path / "training" / "memory.json").read_text())
    peak = report["devices"][0]["measured_peak"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # At the peak the weights, their gradients and Adam's two moments are all on the GPU.
    assert 4 * params <= peak <= highest
    assert report["method"].startswith("peak measured with torch.cuda.max_memory_allocated")


def test_an_over_budget_gpu_configuration_is_refused_before_any_worker_starts(monkeypatch):
    from pipetorch.parallel.host import pool

    on_gpu(monkeypatch, gpus=1)
    started = []
    monkeypatch.setattr(pool, "prestart", lambda *a, **k: started.append(1))
    model, _ = mnist_pair()
    opts = options().setMemoryBudget(1024)  # far below the weights alone
    opts.setExecutionStrategy(poptorch.PipelinedExecution(
        poptorch.Stage("B1", "B2").ipu(0), poptorch.Stage("B3", "B4").ipu(1)))
    wrapped = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1))
    with pytest.raises(OutOfMemoryError, match="IPU 0"):
        wrapped(*mnist_data(D * G * B, seed=0))
    assert not started
    wrapped.destroy()
