"""Stage workers on GPUs: several stages and replicas sharing one GPU (gloo through host
memory), NCCL between GPUs, recomputation and offload; each against plain PyTorch on a GPU."""
import copy

import pytest
import torch

import pipetorch as poptorch
from gpu_cases import CUDA, GPU_TOLERANCE, assert_same_weights, gpus, on_gpu, plain_steps
from helpers.models import MnistNetwork, WithLoss, mnist_data
from helpers.zoo import ResNet, image_data
from pipetorch.parallel.host.engine import ProcessEngine

pytestmark = [pytest.mark.slow, *CUDA]


@pytest.fixture(autouse=True)
def _in_workers(monkeypatch):
    # Workers even where every stage lands on one GPU: that path (gloo through host memory)
    # is what these tests are about, whatever `auto` chooses there.
    monkeypatch.setenv("PIPETORCH_EXECUTION", "processes")

D, B = 2, 4
STAGES = {2: [("B1", "B2"), ("B3", "B4")], 4: [("B1",), ("B2",), ("B3",), ("B4",)]}


def mnist(count):
    torch.manual_seed(0)
    stages = [poptorch.Stage(*group).ipu(i) for i, group in enumerate(STAGES[count])]
    return WithLoss(MnistNetwork()), stages, mnist_data


def resnet(count):
    torch.manual_seed(0)
    net = ResNet(layers=(1, 1, 1, 1), width=4)  # BatchNorm: buffers change in every stage
    net.layer3[0] = poptorch.BeginBlock(net.layer3[0], ipu_id=1)
    return WithLoss(net, block=None), [], lambda n, seed: image_data(n, size=16, seed=seed)


def options(stages, *, sharded, G, R=1):
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All).showCompilationProgressBar(False)
    strategy = poptorch.ShardedExecution if sharded else poptorch.PipelinedExecution
    return opts.setExecutionStrategy(strategy(*stages))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train_both(request, model, opts, make_data, *, G, R=1, make_optimizer=sgd, calls=2):
    """pipetorch's and plain PyTorch's (on the first GPU) losses of `calls` host calls, and
    the wrapper; its weights are checked against the plain model's."""
    plain = copy.deepcopy(model).cuda()
    plain_optimizer = make_optimizer(plain)
    wrapper = poptorch.trainingModel(model, opts, optimizer=make_optimizer(model))
    request.addfinalizer(wrapper.destroy)
    for seed in range(calls):
        x, y = make_data(D * G * R * B, seed=seed)
        _, losses = wrapper(x, y)
        want = plain_steps(plain, plain_optimizer, x, y, D=D, G=G, R=R)
        torch.testing.assert_close(losses.cpu(), want, **GPU_TOLERANCE)
    wrapper.copyWeightsToHost()
    assert_same_weights(model, plain, **GPU_TOLERANCE)
    return wrapper


def workers(wrapper):
    engine = wrapper._compiled.engine
    assert isinstance(engine, ProcessEngine), type(engine)
    return engine


@pytest.mark.parametrize("build, count, sharded", [
    pytest.param(mnist, 2, False, id="mnist-2-pipelined"),
    pytest.param(mnist, 2, True, id="mnist-2-sharded"),
    pytest.param(mnist, 4, False, id="mnist-4-pipelined"),
    pytest.param(mnist, 4, True, id="mnist-4-sharded"),
    pytest.param(resnet, 2, False, id="resnet-2-pipelined"),
])
def test_stages_sharing_one_gpu_train_like_plain_pytorch(request, monkeypatch, build, count,
                                                         sharded):
    on_gpu(monkeypatch, gpus=1)
    model, stages, make_data = build(count)
    G = count if sharded else 2 * count - 1
    wrapper = train_both(request, model, options(stages, sharded=sharded, G=G), make_data, G=G)
    engine = workers(wrapper)
    assert len(engine.worker_pids) == count
    assert sorted(engine.peak_memory) == list(range(count))
    assert min(engine.peak_memory.values()) > 0


@pytest.mark.parametrize("count", [1, 2], ids=["1-stage", "2-stages"])
def test_two_replicas_on_one_gpu_train_like_plain_pytorch(request, monkeypatch, count):
    on_gpu(monkeypatch, gpus=1)
    model, stages, make_data = mnist(2)
    if count == 1:
        stages = [poptorch.Stage("B1", "B2", "B3", "B4").ipu(0)]
    G = 3
    wrapper = train_both(request, model, options(stages, sharded=False, G=G, R=2), make_data,
                         G=G, R=2)
    assert len(workers(wrapper).worker_pids) == 2 * count


@pytest.mark.skipif(gpus() < 2, reason="NCCL between stages needs two GPUs")
def test_stages_on_two_gpus_talk_through_nccl(request, monkeypatch):
    on_gpu(monkeypatch, gpus=2)
    model, stages, make_data = mnist(2)
    wrapper = train_both(request, model, options(stages, sharded=False, G=3), make_data, G=3)
    assert len(workers(wrapper).worker_pids) == 2


def test_recomputation_on_one_gpu_trains_like_plain_pytorch(request, monkeypatch):
    on_gpu(monkeypatch, gpus=1)
    model, stages, make_data = mnist(2)
    opts = options(stages, sharded=False, G=3)
    opts.Training.setRecomputation(True)
    train_both(request, model, opts, make_data, G=3)


def test_offloaded_state_on_one_gpu_trains_like_plain_pytorch(request, monkeypatch):
    on_gpu(monkeypatch, gpus=1)
    model, stages, make_data = mnist(2)
    opts = options(stages, sharded=False, G=3)
    opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(False))
    adam = lambda m: torch.optim.Adam(m.parameters(), lr=0.01, eps=1e-3)  # noqa: E731
    train_both(request, model, opts, make_data, G=3, make_optimizer=adam)
