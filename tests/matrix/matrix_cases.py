"""The differential matrix's models, modes and plain-PyTorch reference loop.

Every cell trains a model for several host calls through pipetorch and, alongside, through a
hand-written PyTorch loop over the same micro-batches; the losses, outputs and weights must
agree after every call. The models differ in where forward returns its loss (PopTorch's rule:
the final loss operation's result, wherever it is returned), the modes in how the model is
split and batched.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils import _pytree as pytree

import pipetorch as poptorch
from helpers.reference import join

WIDTH, CLASSES, B = 8, 4, 2


# -- where forward returns its loss --------------------------------------------------------------
class PenalisedLoss(nn.Module):
    """A custom loss module: two partial identity_loss terms and a final one."""

    def forward(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ce = poptorch.identity_loss(F.cross_entropy(out, labels, reduction="none"), "mean")
        size = poptorch.identity_loss(out.abs(), reduction="mean")
        return poptorch.identity_loss(ce + 0.1 * size, reduction="none")


@functools.cache
def _output_class() -> type:
    from transformers.utils import ModelOutput  # a test dependency; the library never imports it

    @dataclass
    class MatrixOutput(ModelOutput):
        loss: torch.Tensor | None = None
        logits: torch.Tensor | None = None

    return MatrixOutput


def _model_output(**fields: torch.Tensor) -> Any:
    return _output_class()(**fields)


def _define_output_class(variant: str) -> None:
    """Defines the ModelOutput class before forward first runs, as a user's module does at
    import: transformers registers it with torch's pytree only outside compilation."""
    if variant == "model_output":
        _output_class()


def _partials(out: torch.Tensor, labels: torch.Tensor) -> tuple:
    ce = poptorch.identity_loss(F.cross_entropy(out, labels, reduction="none"), "mean")
    square = poptorch.identity_loss(out.pow(2).mean(-1), reduction="sum")
    # both partials are returned too, before and after the final loss
    return ce, poptorch.identity_loss(ce + 0.05 * square, reduction="none"), out, square


@dataclass(frozen=True)
class Variant:
    """How forward returns its loss: `make(model, out, labels)`, and where the loss is."""

    make: Callable[[nn.Module, torch.Tensor, torch.Tensor], Any]
    loss_of: Callable[[Any], torch.Tensor]


def _ce(out: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(out, labels, reduction=reduction)


VARIANTS: dict[str, Variant] = {
    # the BERT tutorial's order: identity_loss first
    "first": Variant(lambda m, o, y: (poptorch.identity_loss(_ce(o, y), reduction="none"), o),
                     lambda r: r[0]),
    "middle": Variant(lambda m, o, y: (o, _ce(o, y), o.argmax(-1)), lambda r: r[1]),
    "last": Variant(lambda m, o, y: (o, _ce(o, y)), lambda r: r[-1]),
    "dict": Variant(lambda m, o, y: {"logits": o, "loss": _ce(o, y)}, lambda r: r["loss"]),
    "model_output": Variant(lambda m, o, y: _model_output(loss=_ce(o, y), logits=o),
                            lambda r: r.loss),
    "partials": Variant(lambda m, o, y: _partials(o, y), lambda r: r[1]),
    "loss_module": Variant(lambda m, o, y: (o, m.criterion(o, y)), lambda r: r[1]),
    "identity_sum": Variant(
        lambda m, o, y: (o, poptorch.identity_loss(_ce(o, y, "none"), reduction="sum")),
        lambda r: r[1]),
    "identity_mean": Variant(
        lambda m, o, y: (poptorch.identity_loss(_ce(o, y, "none"), reduction="mean"), o),
        lambda r: r[0]),
    # one loss per sample, trained on their sum (PopTorch back-propagates ones)
    "identity_none": Variant(
        lambda m, o, y: (o, poptorch.identity_loss(_ce(o, y, "none"), reduction="none")),
        lambda r: r[1]),
}


# -- models --------------------------------------------------------------------------------------
class MatrixNet(nn.Module):
    """Four layers (one block each once annotated), a head, and the loss as `variant` says;
    optionally a BatchNorm after layer 1 and layer 3's weight tied to layer 0's."""

    def __init__(self, variant: str = "last", *, batchnorm: bool = False,
                 tied: bool = False) -> None:
        super().__init__()
        _define_output_class(variant)
        self.variant = variant
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.norm = nn.BatchNorm1d(WIDTH) if batchnorm else nn.Identity()
        self.head = nn.Linear(WIDTH, CLASSES)
        self.criterion = PenalisedLoss()
        if tied:
            self.layers[3].weight = self.layers[0].weight

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
        for index, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if index == 1:
                x = self.norm(x)
        return VARIANTS[self.variant].make(self, self.head(x), labels)


class ConvNet(nn.Module):
    """A small CNN in four blocks: three convolutions and a pooled linear head."""

    def __init__(self, variant: str = "last") -> None:
        super().__init__()
        _define_output_class(variant)
        self.variant = variant
        self.layers = nn.ModuleList([
            nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(4, 8, 3, stride=2, padding=1), nn.ReLU()),
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, CLASSES)),
        ])

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
        for layer in self.layers:
            x = layer(x)
        return VARIANTS[self.variant].make(self, x, labels)


def annotate(model: nn.Module, ipus: list[int]) -> nn.Module:
    """BeginBlock on each of the model's four layers, on the given ipus."""
    for index, ipu in enumerate(ipus):
        model.layers[index] = poptorch.BeginBlock(model.layers[index], f"L{index}", ipu_id=ipu)
    return model


def make_data(model: nn.Module, n: int, seed: int, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(seed)
    shape = (n, 1, 8, 8) if isinstance(model, ConvNet) else (n, WIDTH)
    return torch.randn(shape, generator=g).to(dtype), torch.randint(0, CLASSES, (n,), generator=g)


# -- modes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mode:
    """How a model is split and batched: its ipus per layer, strategy, G and R (D is 2)."""

    ipus: tuple[int, ...] | None
    strategy: Callable[[Any], Any] | None
    G: int
    R: int = 1
    processes: int = 1
    schedule: str | None = None  # Training.pipelineSchedule, when not the default
    recomputation: bool = False  # Training.setRecomputation

    def options(self) -> poptorch.Options:
        opts = poptorch.Options().deviceIterations(D).replicationFactor(self.R)
        opts.Training.gradientAccumulation(self.G)
        opts.outputMode(poptorch.OutputMode.All).showCompilationProgressBar(False)
        if self.R > 1:
            opts.broadcastBuffers(False)  # each replica keeps its own BatchNorm statistics
        if self.strategy is not None:
            opts.setExecutionStrategy(self.strategy(self))
        if self.schedule is not None:
            opts.Training.pipelineSchedule(self.schedule)
        if self.recomputation:
            opts.Training.setRecomputation(True)
        return opts


D = 2
SAME, AUTO = poptorch.AutoStage.SameAsIpu, poptorch.AutoStage.AutoIncrement
MODES: dict[str, Mode] = {
    "one_device": Mode(None, None, G=2),
    "sharded_2": Mode((0, 0, 1, 1), lambda m: poptorch.ShardedExecution(SAME), G=2, processes=2),
    "pipelined_2": Mode((0, 0, 1, 1), lambda m: poptorch.PipelinedExecution(SAME), G=3,
                        processes=2),
    # the same with each backward split: input gradients first, weight gradients deferred
    "zero_bubble_2": Mode((0, 0, 1, 1), lambda m: poptorch.PipelinedExecution(SAME), G=3,
                          processes=2, schedule="zero_bubble"),
    "zero_bubble_2_recomputed": Mode((0, 0, 1, 1), lambda m: poptorch.PipelinedExecution(SAME),
                                     G=3, processes=2, schedule="zero_bubble",
                                     recomputation=True),
    "zero_bubble_2_replicas_2": Mode((0, 0, 1, 1),
                                     lambda m: poptorch.PipelinedExecution(SAME), G=3, R=2,
                                     processes=2, schedule="zero_bubble"),
    "auto_2": Mode((0, 0, 1, 1), lambda m: poptorch.PipelinedExecution(SAME), G=3,
                   processes=2, schedule="auto"),
    # four stages round-robin on two devices (ipus 0,1,0,1): interleaved 1F1B over them
    "interleaved_4_on_2": Mode((0, 1, 0, 1), lambda m: poptorch.PipelinedExecution(SAME),
                               G=8, processes=2, schedule="interleaved"),
    "interleaved_zero_bubble_4_on_2": Mode((0, 1, 0, 1),
                                           lambda m: poptorch.PipelinedExecution(SAME), G=8,
                                           processes=2, schedule="interleaved_zero_bubble"),
    "auto_4_on_2": Mode((0, 1, 0, 1), lambda m: poptorch.PipelinedExecution(SAME), G=8,
                        processes=2, schedule="auto"),
    # AutoIncrement: four stages, two on each device (BERT tutorial's layout)
    "autoincrement_4_on_2": Mode((0, 0, 1, 1), lambda m: poptorch.ShardedExecution(AUTO), G=2,
                                 processes=2),
    "replicas_2": Mode(None, None, G=2, R=2, processes=2),
}


# -- the reference -------------------------------------------------------------------------------
class ReplicaBuffers:
    """Each replica's own buffers in the plain model (broadcastBuffers(False))."""

    def __init__(self, model: nn.Module, replicas: int) -> None:
        self.model = model
        self.copies = [{n: b.clone() for n, b in model.named_buffers()} for _ in range(replicas)]

    def swap_in(self, replica: int) -> None:
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                buffer.copy_(self.copies[replica][name])

    def keep(self, replica: int) -> None:
        self.copies[replica] = {n: b.clone() for n, b in self.model.named_buffers()}


def plain_call(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: tuple, *,
               G: int, R: int, loss_of: Callable[[Any], torch.Tensor], buffers: ReplicaBuffers,
               loss_scale: float = 1.0) -> Any:
    """One PopTorch host call by hand: D steps, each over G x R micro-batches ([D][G][R]),
    the loss averaged over them; outputs joined as OutputMode.All returns them."""
    outputs = []
    for d in range(D):
        optimizer.zero_grad()
        for g in range(G):
            for r in range(R):
                i = (d * G + g) * R + r
                buffers.swap_in(r)
                output = model(*(t[i * B:(i + 1) * B] for t in inputs))
                buffers.keep(r)
                loss = loss_of(output)
                ((loss.sum() if loss.dim() else loss) * (loss_scale / (G * R))).backward()
                outputs.append(pytree.tree_map(lambda t: t.detach(), output))
        if loss_scale != 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad /= loss_scale
        optimizer.step()
    buffers.swap_in(0)  # the host copy shows replica 0's buffers
    return join(outputs)


def assert_same_output(got: Any, want: Any, *, what: str, **tolerance: float) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert type(got) is type(want) and got_spec == want_spec, f"{what}: {got_spec} != {want_spec}"
    for index, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        assert_close(g, w, msg=lambda m, i=index: f"{what} output leaf {i}: {m}", **tolerance)


def assert_same_state(got: nn.Module, want: nn.Module, *, what: str, **tolerance: float) -> None:
    want_state = want.state_dict()
    got_state = got.state_dict()
    assert list(got_state) == list(want_state), what
    for name, value in want_state.items():
        assert_close(got_state[name], value, msg=lambda m, n=name: f"{what} {n}: {m}",
                     **tolerance)


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
