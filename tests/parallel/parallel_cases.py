"""Models split over 2, 3 and 4 devices, their options, and checks for the multi-process tests."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import MnistNetwork, WithLoss, mnist_data
from helpers.reference import expected_outputs, plain_train_call
from helpers.zoo import ResNet, TransformerClassifier, image_data, token_data
from pipetorch.parallel.host.engine import ProcessEngine
from pipetorch.parallel.host.local import LocalEngine

EXECUTION_ENV = "PIPETORCH_EXECUTION"
THREADS_ENV = "PIPETORCH_THREADS_PER_DEVICE"

Batch = tuple[torch.Tensor, torch.Tensor]
MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]


class SkipNet(nn.Module):
    """Three blocks: `h` from A is read again in C, so it is relayed through B; B's first op is
    an in-place ReLU on the value it receives from A.

    With `mutate_relayed`, that value is `h` itself: C must then read the rectified `h`, as
    it does in plain PyTorch.
    """

    def __init__(self, *, mutate_relayed: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.relu = nn.ReLU(inplace=True)
        self.mutate_relayed = mutate_relayed

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        with poptorch.Block("A"):
            h = self.a(x)
            u = h if self.mutate_relayed else h * 2
        with poptorch.Block("B"):
            g = self.relu(u)  # the first op after the boundary changes its input in place
            g = torch.tanh(self.b(g))
        with poptorch.Block("C"):
            out = self.c(g + h)  # the skip connection over B's stage
            if labels is None:
                return out
            loss = F.cross_entropy(out, labels)
        return out, loss


@dataclass
class Case:
    """A model annotated for `count` stages, the strategy arguments that split it, its data."""

    name: str
    model: nn.Module  # forward(inputs, labels) -> (output, loss); forward(inputs) -> output
    stages: tuple[poptorch.Stage, ...]  # () when BeginBlock ipu_ids place the stages
    make_data: Callable[[int, int], Batch]
    count: int

    def data(self, n: int, *, seed: int) -> Batch:
        return self.make_data(n, seed)


def mnist_case(count: int) -> Case:
    """Seed 000's CNN, its blocks B1..B4 grouped into 2 or 4 stages."""
    torch.manual_seed(0)
    groups = {2: [("B1", "B2"), ("B3", "B4")], 4: [("B1",), ("B2",), ("B3",), ("B4",)]}[count]
    stages = tuple(poptorch.Stage(*g).ipu(i) for i, g in enumerate(groups))
    return Case(f"mnist{count}", WithLoss(MnistNetwork()), stages,
                lambda n, seed: mnist_data(n, seed=seed), count)


def resnet_case(count: int) -> Case:
    """The zoo's ResNet (BatchNorm throughout), BeginBlock on the first block of later layers."""
    torch.manual_seed(0)
    net = ResNet(layers=(1, 1, 1, 1), width=4)
    starts = {2: ["layer3"], 4: ["layer2", "layer3", "layer4"]}[count]
    for ipu, name in enumerate(starts, start=1):
        layer = getattr(net, name)
        layer[0] = poptorch.BeginBlock(layer[0], ipu_id=ipu)  # as seeds 002/003 do
    return Case(f"resnet{count}", WithLoss(net, block=None), (),
                lambda n, seed: image_data(n, size=16, seed=seed), count)


def transformer_case(count: int) -> Case:
    """The zoo's transformer, one encoder layer per stage (BeginBlock as seed 003's BERT)."""
    torch.manual_seed(0)
    model = TransformerClassifier(dim=8, heads=2, depth=count, max_length=6)
    for ipu in range(1, count):
        model.layers[ipu] = poptorch.BeginBlock(model.layers[ipu], ipu_id=ipu)
    return Case(f"transformer{count}", model, (),
                lambda n, seed: token_data(n, length=6, seed=seed), count)


def skip_case(count: int = 3, *, mutate_relayed: bool = False) -> Case:
    """SkipNet over 3 stages (3 devices: autoRoundNumIPUs is set by `options`)."""
    assert count == 3, "SkipNet has exactly three blocks"
    torch.manual_seed(0)

    def make_data(n: int, seed: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)

    stages = tuple(poptorch.Stage(b).ipu(i) for i, b in enumerate("ABC"))
    return Case("skip3" + ("-mutating" if mutate_relayed else ""),
                SkipNet(mutate_relayed=mutate_relayed), stages, make_data, 3)


BUILDERS: dict[str, Callable[[int], Case]] = {
    "mnist": mnist_case, "resnet": resnet_case, "transformer": transformer_case, "skip": skip_case,
}


def options(case: Case, *, sharded: bool, D: int, G: int = 1, R: int = 1, mode: str = "All",
            period: int | None = None) -> Any:
    """Options splitting `case` over its stages, pipelined or sharded."""
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R).autoRoundNumIPUs(True)
    opts.Training.gradientAccumulation(G)
    if mode == "EveryN":
        opts.outputMode(poptorch.OutputMode.EveryN, output_return_period=period)
    else:
        opts.outputMode(getattr(poptorch.OutputMode, mode))
    strategy = poptorch.ShardedExecution if sharded else poptorch.PipelinedExecution
    opts.setExecutionStrategy(strategy(*case.stages))
    return opts.showCompilationProgressBar(False)


def one_thread_everywhere(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers and this process compute with one thread each for the rest of the test.

    CPU convolutions add up their terms in an order that depends on the thread count, and a
    few training steps of a BatchNorm network with micro-batches of 2 turn those last-bit
    differences into visible ones: with equal thread counts the runs must agree to float
    tolerance.
    """
    monkeypatch.setenv(THREADS_ENV, "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(before))


def cleaned(request: pytest.FixtureRequest, wrapper: Any) -> Any:
    """`wrapper`, destroyed (its workers stopped) when the test ends."""
    request.addfinalizer(wrapper.destroy)
    return wrapper


def assert_in_processes(wrapper: Any, count: int) -> None:
    """The wrapper really ran one worker process per stage."""
    engine = wrapper._compiled.engine
    assert isinstance(engine, ProcessEngine), type(engine)
    assert len(engine.worker_pids) == count


def local_wrapper(monkeypatch: pytest.MonkeyPatch, build: Callable[[], Any],
                  first: tuple) -> tuple[Any, Any]:
    """Build a wrapper and run its first call with every stage in this process (LocalEngine)."""
    with monkeypatch.context() as env:
        env.setenv(EXECUTION_ENV, "local")
        wrapper = build()
        result = wrapper(*first)
    assert isinstance(wrapper._compiled.engine, LocalEngine)
    return wrapper, result


def assert_same_state(got: nn.Module, want: nn.Module, *, what: str = "") -> None:
    """Every parameter and buffer (BatchNorm statistics, counters) of the two models."""
    got_state, want_state = got.state_dict(), want.state_dict()
    assert list(got_state) == list(want_state)
    for name, value in want_state.items():
        assert_close(got_state[name], value, msg=lambda m, name=name: f"{what}{name}: {m}")


def assert_same_result(got: Any, want: Any, *, what: str) -> None:
    """Outputs and losses of one call: same shapes, values to float tolerance."""
    got_list = list(got) if isinstance(got, (tuple, list)) else [got]
    want_list = list(want) if isinstance(want, (tuple, list)) else [want]
    assert len(got_list) == len(want_list), what
    for index, (g, w) in enumerate(zip(got_list, want_list)):
        assert g.shape == w.shape, f"{what}[{index}]: {tuple(g.shape)} != {tuple(w.shape)}"
        assert_close(g.as_subclass(torch.Tensor), w.as_subclass(torch.Tensor),
                     msg=lambda m, index=index: f"{what}[{index}]: {m}")


TIED_VOCAB, TIED_WIDTH = 12, 8


class TiedHead(nn.Module):
    """GPT-2's shape: the head reuses the embedding's weight. The embedding (before the first
    block) runs on ipu 0, the head on `head_ipu`; with `mid_ipu`, a layer between them begins
    a block on that ipu (else it runs with the embedding)."""

    def __init__(self, *, head_ipu: int, mid_ipu: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(TIED_VOCAB, TIED_WIDTH)
        self.mid = nn.Linear(TIED_WIDTH, TIED_WIDTH)
        if mid_ipu is not None:
            self.mid = poptorch.BeginBlock(self.mid, ipu_id=mid_ipu)
        self.head = poptorch.BeginBlock(nn.Linear(TIED_WIDTH, TIED_VOCAB, bias=False),
                                        ipu_id=head_ipu)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor):
        out = self.head(torch.tanh(self.mid(self.embed(tokens))))
        return out, F.cross_entropy(out, labels)


def tied_tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, TIED_VOCAB, (n,), generator=g),
            torch.randint(0, TIED_VOCAB, (n,), generator=g))


def train_and_compare(request: pytest.FixtureRequest, model: nn.Module, opts: Any, *, D: int,
                      G: int, R: int = 1, calls: int = 2, make_optimizer: MakeOptimizer,
                      make_data: Callable[[int, int], Batch], batch: int = 2) -> Any:
    """Train `model` for `calls` host calls (micro-batches of `batch`) and plain PyTorch
    alongside: same outputs and losses at every call, same weights at the end; returns the
    wrapper."""
    plain = copy.deepcopy(model)
    plain_optimizer = make_optimizer(plain)
    wrapper = cleaned(request, poptorch.trainingModel(model, opts,
                                                      optimizer=make_optimizer(model)))
    for seed in range(calls):
        inputs = make_data(D * G * R * batch, seed)
        got = wrapper(*inputs)
        rows = plain_train_call(plain, plain_optimizer, *inputs, D=D, G=G, R=R)
        expected = expected_outputs(rows, "All", steps=D * G, R=R)
        assert_same_result(got, expected, what=f"call {seed} vs plain PyTorch")
    assert_same_state(wrapper.model, plain, what="vs plain PyTorch: ")
    return wrapper


def plain_call(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, *, D: int,
               G: int, R: int = 1, mode: str = "All", period: int | None = None) -> Batch:
    """What one host call returns, computed by the plain-PyTorch hand loop."""
    rows = plain_train_call(model, optimizer, *batch, D=D, G=G, R=R)
    return expected_outputs(rows, mode, steps=D * G, R=R, period=period or 1)


def twin(model: nn.Module) -> nn.Module:
    """An independent copy (weights, buffers, BeginBlock annotations) made before wrapping."""
    return copy.deepcopy(model)
