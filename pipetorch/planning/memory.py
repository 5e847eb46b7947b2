"""The memory model: bytes of tensors and optimiser state, and what a micro-batch's forward keeps.

Optimiser state is sized from the optimiser's state tensors (or, before the first step reached
the host copy, from the state one step creates on stand-ins of the parameters' dtypes). The
activations kept for backward are found by one forward of each stage on fake tensors under
saved-tensor hooks (`Footprint`): the values the stage received, the tensors autograd saved
and the values it produced, each storage once.
At the schedule's peak a stage holds all three for each stashed micro-batch
(`schedule.simulator`' peak stash); with recomputation only what it received and produced,
plus one micro-batch's saved tensors while its backward recomputes them (`kept_bytes`).
The estimate before a run (`planning.estimate`) and a run's memory.json (`profiling.memory`)
both price with these.
"""
from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple, TypeVar

import torch
import torch.nn as nn

from pipetorch.losses import tensor_leaves
from pipetorch.partition.split import Source

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipetorch.options.options import Options
    from pipetorch.partition.split import StagedModel
    from pipetorch.schedule.plans import Batching

__all__: list[str] = []

_Output = TypeVar("_Output")

logger = logging.getLogger(__name__)


def bytes_of(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of some tensors, each counted whole."""
    return sum(t.numel() * t.element_size() for t in tensors)


def optimiser_state_bytes(optimizer: torch.optim.Optimizer | None,
                          params: list[nn.Parameter], *,
                          dtype: torch.dtype | None = None) -> tuple[int, str]:
    """Bytes of `optimizer`'s state for `params`, and how they were found.

    With `dtype`, the state the optimiser would keep if every parameter had that dtype (what
    `model.half()` would make of it), from one step on stand-ins.
    """
    if optimizer is None or not params:
        return 0, "no optimiser"
    present = [p for p in params if optimizer.state.get(p)]
    if dtype is None and len(present) == len(params):
        return sum(bytes_of(v for v in optimizer.state[p].values()
                            if isinstance(v, torch.Tensor)) for p in params), "state tensors"
    try:
        per_element = state_layout(optimizer, params, dtype)
    except Exception as exc:  # an optimiser that cannot step on stand-ins: say so, guess nothing
        logger.warning("Cannot size the state of %s: %s", type(optimizer).__name__, exc)
        return 0, f"unknown ({type(optimizer).__name__} could not step on stand-ins)"
    total = 0
    for p in params:
        per_tensor, fixed = per_element[id(p)]
        total += per_tensor * p.numel() + fixed
    return total, "estimated from the state one step creates"


def state_layout(optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                  dtype: torch.dtype | None) -> dict[int, tuple[int, int]]:
    """Per parameter: (state bytes per element of the parameter, bytes of scalar state)."""
    def stand_in_for(p: nn.Parameter) -> nn.Parameter:
        return nn.Parameter(torch.ones(2, dtype=dtype or p.dtype))

    stand_ins = {id(p): stand_in_for(p) for p in params}
    everything = [p for g in optimizer.param_groups for p in g["params"]]
    memo = {id(p): stand_ins[id(p)] if id(p) in stand_ins else stand_in_for(p)
            for p in everything}
    clone = copy.deepcopy(optimizer, dict(memo))
    clone.state.clear()
    for stand_in in memo.values():
        stand_in.grad = torch.full_like(stand_in, 0.5)
    clone.step()
    layout = {}
    for key, stand_in in stand_ins.items():
        state = [v for v in clone.state.get(stand_in, {}).values() if isinstance(v, torch.Tensor)]
        per_element = sum(v.element_size() for v in state if v.numel() == stand_in.numel()
                          and v.dim() > 0)
        fixed = sum(v.numel() * v.element_size() for v in state
                    if not (v.numel() == stand_in.numel() and v.dim() > 0))
        layout[key] = (per_element, fixed)
    return layout


class Size(NamedTuple):
    """Bytes as they are, and as they would be with every float wider than 16 bits halved."""

    bytes: int
    half: int

    def __add__(self, other: object) -> "Size":
        assert isinstance(other, Size)
        return Size(self.bytes + other.bytes, self.half + other.half)

    def scaled(self, factor: int) -> "Size":
        return Size(self.bytes * factor, self.half * factor)


ZERO = Size(0, 0)


def size_of(tensors: Iterable[torch.Tensor]) -> Size:
    """The Size of some tensors (each counted whole, shared storages more than once)."""
    total = ZERO
    for t in tensors:
        total += sized(t, t.numel() * t.element_size())
    return total


def sized(tensor: torch.Tensor, nbytes: int) -> Size:
    wide = tensor.is_floating_point() and tensor.element_size() > 2
    return Size(nbytes, nbytes * 2 // tensor.element_size() if wide else nbytes)


class Footprint(NamedTuple):
    """What one micro-batch's forward leaves on its stage, each storage counted once: the
    values it received (host inputs and values from other stages), the values it produced
    (kept until their gradients come back), and the other tensors autograd saved for
    backward (weights excluded)."""

    received: Size
    saved: Size
    outputs: Size
    largest: Size = ZERO  # the largest single tensor saved or produced

    @property
    def total(self) -> Size:
        return self.received + self.saved + self.outputs


def measure_forward(forward: Callable[..., _Output], values: list[object],
                    weights: list[torch.Tensor], *, training: bool,
                    fake: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> tuple[Footprint, _Output]:
    """Run `forward(*values)` once (with gradients when `training`) and size its Footprint;
    `weights` are the module's parameters and buffers, never counted as activations.

    Tensor values are given to forward as fresh copies, as a stage worker receives them, so
    views of a larger batch count only their own bytes. With `fake` (a FakeTensorMode's
    `from_tensor`, the mode active) the values and weights are fake tensors: storages and
    saved tensors as a real run makes them, and nothing computed. Returns the Footprint and the
    output.
    """
    if fake is not None:
        values = [fake(v) if isinstance(v, torch.Tensor) else v for v in values]
        weights = [fake(w) for w in weights]
    weight_keys = {storage_key(w) for w in weights}
    values = [v.detach().clone().requires_grad_(v.requires_grad)
              if isinstance(v, torch.Tensor) else v for v in values]
    storages: dict[int, Size] = {}
    received = {storage_key(t) for t in tensor_leaves(values)}
    for t in tensor_leaves(values):
        storages.setdefault(storage_key(t), sized(t, t.untyped_storage().nbytes()))
    saved: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in weight_keys and key not in received:
            saved.add(key)
            storages.setdefault(key, sized(tensor, tensor.untyped_storage().nbytes()))
        return tensor

    with torch.set_grad_enabled(training), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = forward(*values)
    produced = set()
    for t in tensor_leaves(output):
        key = storage_key(t)
        if key not in weight_keys and key not in received:
            produced.add(key)
            storages.setdefault(key, sized(t, t.untyped_storage().nbytes()))
    saved -= produced  # a produced value stays for backward even when recomputing

    def total(keys: set[int]) -> Size:
        return sum((storages[k] for k in keys), ZERO)

    return Footprint(total(received), total(saved), total(produced),
                     largest([storages[k] for k in saved | produced])), output


def largest(sizes: Iterable[Size]) -> Size:
    """The largest of some tensors' Sizes (ZERO for none)."""
    return max(sizes, key=lambda size: size.bytes, default=ZERO)


def backward_transient(footprint: Footprint, *, recomputation: bool) -> Size:
    """What one micro-batch's backward holds beyond its kept tensors at its fullest: reaching
    the op that made the stage's largest tensor, autograd holds that tensor's gradient and the
    gradient of the op's input at once, both its size; recomputing, the forward run again
    makes the stage's outputs again beside the kept ones. A language model's head shows both:
    at 512 tokens and a vocabulary of 32768 its backward peaks at 4x the logits' 64 MiB, the
    forward at 2x (the logits and the log-softmax's output; on this CPU with a worker's
    allocator settings), and recomputing its last stage measured 53 MiB over 1F1B's peak."""
    return footprint.largest.scaled(2) + (footprint.outputs if recomputation else ZERO)


def fake_tensors() -> FakeTensorMode:
    """A FakeTensorMode that turns the real tensors an op meets (weights) into fake ones;
    `from_tensor` of it gives the fake tensor of a real one, the same for every call."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # imports sympy: only when sizing

    return FakeTensorMode(allow_non_fake_inputs=True)


def faked(mode: FakeTensorMode) -> Callable[[torch.Tensor], torch.Tensor]:
    """`mode.from_tensor` for real tensors; fake tensors (earlier stages' outputs) as they are."""
    from torch._subclasses.fake_tensor import FakeTensor

    return lambda t: t if isinstance(t, FakeTensor) else mode.from_tensor(t)


def kept_bytes(footprint: Footprint, in_flight: int, *, training: bool,
               recomputation: bool) -> tuple[Size, Size]:
    """(activations, received values) a stage holds at its peak with `in_flight` micro-batches
    awaiting backward. Inference keeps one micro-batch's inputs and nothing for backward.
    Recomputation keeps each micro-batch's inputs and outputs only, and re-creates the saved
    tensors of one micro-batch at a time during backward."""
    if not training:
        return ZERO, footprint.received
    received = footprint.received.scaled(in_flight)
    if recomputation:
        return footprint.outputs.scaled(in_flight) + footprint.saved, received
    return (footprint.saved + footprint.outputs).scaled(in_flight), received


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """A module's parameters and buffers (model state: never counted as activations)."""
    return [*module.parameters(), *module.buffers()]


def storage_key(tensor: torch.Tensor) -> int:
    # The storage object's identity: a fake tensor's (meta) storage has no data pointer.
    return tensor.untyped_storage()._cdata


def staged_footprints(staged: StagedModel, args: tuple, kwargs: dict, *,
                      training: bool) -> list[Footprint]:
    """Each stage's Footprint, running the captured stages in order on fake tensors of one
    micro-batch: nothing is computed and no graph holds real memory. A stage receives the
    host inputs it reads and the bundle from the stage before it, which holds the values it
    relays (`parallel.layout.routes`) as well as those it reads. Raises what fake tensors raise on a
    graph they cannot run (an op without a fake kernel)."""
    from pipetorch.parallel.layout.routes import routes_of

    with fake_tensors() as mode:
        fake = faked(mode)
        inputs = staged.flatten_inputs(*args, **kwargs)
        produced: dict[Source, object] = {}
        result = []
        for j, (module, io, route) in enumerate(zip(staged.modules, staged.io,
                                                    routes_of(staged), strict=True)):
            values = [inputs[s[1]] if s.kind == "input" else produced[s] for s in io.inputs]
            relayed = [produced[s] for s in route.receive if s not in io.inputs]
            footprint, outputs = measure_forward(lambda *v, m=module: m(*v), values,
                                                 module_tensors(module), training=training,
                                                 fake=fake)
            extra = size_of(tensor_leaves(relayed))
            result.append(footprint._replace(received=footprint.received + extra))
            for k, value in enumerate(outputs):
                produced[Source.stage(j, k)] = value
    return result


def replica_plan_length(batching: Batching, *, training: bool) -> int:
    """Micro-batches one run of a replica's plan covers: G (training) or D (inference)."""
    return batching.gradient_accumulation if training else batching.device_iterations


def offloaded(options: Options) -> bool:
    """Whether the options keep the optimiser state in host memory."""
    location = getattr(getattr(options, "TensorLocations", None), "optimizer_location", None)
    return location is not None and location.use_on_chip_storage is False


def sharded_above(options: Options) -> int | None:
    """With replicated tensor sharding (TensorLocations.setOptimizerLocation(
    ...useReplicatedTensorSharding(True))), the most elements of a weight whose optimiser state
    stays whole (minElementsForReplicatedTensorSharding, unset: PopART's 8192); else None."""
    from pipetorch.parallel.worker.sharded_step import DEFAULT_MIN_ELEMENTS

    location = getattr(getattr(options, "TensorLocations", None), "optimizer_location", None)
    if location is None or not location.use_replicated_tensor_sharding:
        return None
    found = location.min_elements_for_replicated_tensor_sharding
    return DEFAULT_MIN_ELEMENTS if found is None else found


def per_replica(state: int, whole: int, shards: int) -> int:
    """Optimiser state bytes one of `shards` replicas keeps with replicated tensor sharding:
    `whole` (the state of the weights too small to shard) whole, 1/R of the rest."""
    return whole + -(-(state - whole) // shards)


def recomputing(options: Options) -> bool:
    """Whether the options checkpoint every stage's activations (Training.recomputation)."""
    return bool(getattr(getattr(options, "Training", None), "recomputation", False))
