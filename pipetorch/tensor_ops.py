"""PopTorch's tensor ops beyond the basics: dynamic slices, serialized matmuls, IO overlap
markers, CTC beam search decoding, and custom_op (IPU-only)."""
from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Mapping, Sequence, TypeAlias, TypeVar, Union

import torch
from torch.utils import _pytree as pytree

from pipetorch.enums import MatMulSerializationMode, OverlapMode
from pipetorch.errors import IpuOnlyError, createPoptorchError

if TYPE_CHECKING:
    from pipetorch.extensions import AttributeValue

__all__ = ["dynamic_slice", "dynamic_update", "serializedMatMul", "set_overlap_for_input",
           "set_overlap_for_output", "ctc_beam_search_decoder", "custom_op"]

# What the overlap markers take: a tensor, or tuples, lists and dicts of them to any depth.
TensorStructure: TypeAlias = Union[torch.Tensor, Sequence["TensorStructure"],
                                   Mapping[str, "TensorStructure"]]
_Tensors = TypeVar("_Tensors", bound=TensorStructure)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise createPoptorchError(message)


def _indices(op: str, start: torch.Tensor, dim_size: int, size: int, step: int = 1) -> torch.Tensor:
    """start, start+step, ... below start+size, as a tensor: start stays a run-time value, so
    the op traces (torch.export) without reading it."""
    _check(isinstance(start, torch.Tensor),
           f"Slice start argument to {op} must be a torch.tensor. {type(start)} is not supported.")
    first = start.reshape(-1)[:1].long()
    if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
        index = int(first)
        _check(0 <= index and index + size <= dim_size,
               f"{op}: the slice [{index}, {index + size}) is outside the dimension of size "
               f"{dim_size}; keep start in [0, {dim_size - size}]")
    return torch.arange(0, size, step, device=start.device) + first.to(start.device)


def dynamic_slice(tensor: torch.Tensor, dim: int, start: torch.Tensor, size: int,
                  step: int) -> torch.Tensor:
    """`tensor[start:start+size:step]` along `dim`, with `start` a tensor read at run time."""
    _check(isinstance(tensor, torch.Tensor),
           f"dynamic_slice must take a torch.tensor input. {type(tensor)} is not supported.")
    _check(isinstance(dim, int), "Dimension must be an integer.")
    _check(isinstance(size, int), "Size must be an integer.")
    _check(isinstance(step, int) and step >= 1, "Step must be an integer.")
    rows = _indices("dynamic_slice", start, tensor.shape[dim], size, step)
    return tensor.index_select(dim, rows.to(tensor.device))


def dynamic_update(input: torch.Tensor, src: torch.Tensor, dim: int, start: torch.Tensor,
                   size: int) -> torch.Tensor:
    """A copy of `input` whose `size` entries from `start` along `dim` are `src`."""
    _check(isinstance(input, torch.Tensor),
           f"dynamic_update must take a torch.tensor input. {type(input)} is not supported.")
    _check(isinstance(dim, int), "Dimension must be an integer.")
    _check(isinstance(src, torch.Tensor), "Src argument to dynamic_update must be a "
           f"torch.tensor. {type(src)} is not supported.")
    _check(isinstance(size, int), "Size must be an integer.")
    _check(input.dim() == src.dim(), "input and src tensors must have same dimensionality. "
           f"({input.dim()}) vs ({src.dim()})")
    _check(input.dtype == src.dtype,
           f"input and src tensor must have same dtype. ({input.dtype} vs {src.dtype})")
    rows = _indices("dynamic_update", start, input.shape[dim], size)
    return input.index_copy(dim, rows.to(input.device), src)


def serializedMatMul(lhs: torch.Tensor, rhs: torch.Tensor, mode: MatMulSerializationMode,
                     factor: int = 0, keep_precision: bool = False) -> torch.Tensor:
    """`lhs @ rhs` computed as `factor` smaller matmuls split along `mode`'s dimension.

    With ReducingDim the partial products are summed, in float32 when `keep_precision`.
    """
    if not isinstance(mode, MatMulSerializationMode):
        raise TypeError(f"serializedMatMul: mode must be a poptorch.MatMulSerializationMode, "
                        f"got {mode!r}")
    if not isinstance(factor, int) or isinstance(factor, bool) or factor < 0:
        raise ValueError(f"serializedMatMul: factor must be an int >= 0, got {factor!r}")
    if not isinstance(keep_precision, bool):
        raise TypeError(f"serializedMatMul: keep_precision must be a bool, got {keep_precision!r}")
    if mode == MatMulSerializationMode.Disabled or factor <= 1:
        return torch.matmul(lhs, rhs)
    dims = {MatMulSerializationMode.InputChannels: (lhs, -2),
            MatMulSerializationMode.ReducingDim: (lhs, -1),
            MatMulSerializationMode.OutputChannels: (rhs, -1)}
    split, dim = dims[mode]
    if split.shape[dim] % factor:
        raise ValueError(f"serializedMatMul: factor ({factor}) must divide the {mode.name} "
                         f"dimension ({split.shape[dim]})")
    if mode == MatMulSerializationMode.InputChannels:
        return torch.cat([torch.matmul(part, rhs) for part in lhs.chunk(factor, -2)], -2)
    if mode == MatMulSerializationMode.OutputChannels:
        return torch.cat([torch.matmul(lhs, part) for part in rhs.chunk(factor, -1)], -1)
    sum_dtype = torch.float32 if keep_precision and lhs.dtype == torch.float16 else lhs.dtype
    parts = [torch.matmul(a, b).to(sum_dtype)
             for a, b in zip(lhs.chunk(factor, -1), rhs.chunk(factor, -2), strict=True)]
    return torch.stack(parts).sum(0).to(torch.result_type(lhs, rhs))


def _set_overlap(what: str, tensors: _Tensors, mode: OverlapMode) -> _Tensors:
    if not isinstance(mode, OverlapMode):
        raise TypeError(f"set_overlap_for_{what}: mode must be a poptorch.OverlapMode, got {mode!r}")
    for leaf in pytree.tree_leaves(tensors):
        _check(isinstance(leaf, torch.Tensor), f"You may only set overlap for torch.tensor "
               f"{what}s. {type(leaf)} is not supported.")
    # Overlapping host IO with compute needs IPU IO tiles; here the tensors pass unchanged.
    return tensors


def set_overlap_for_input(input_tensors: _Tensors, mode: OverlapMode) -> _Tensors:
    """Mark inputs for host-IO overlap (an IPU IO-tile setting); returns them unchanged."""
    return _set_overlap("input", input_tensors, mode)


def set_overlap_for_output(output_tensors: _Tensors, mode: OverlapMode) -> _Tensors:
    """Mark outputs for host-IO overlap (an IPU IO-tile setting); returns them unchanged."""
    return _set_overlap("output", output_tensors, mode)


def _logsumexp(*values: float) -> float:
    top = max(values)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(v - top) for v in values))


def _beam_search(log_probs: list[list[float]], blank: int, beam_width: int
                 ) -> list[tuple[tuple[int, ...], float]]:
    """CTC prefix beam search over one sequence: [(labels, log probability)], best first."""
    beams: dict[tuple[int, ...], tuple[float, float]] = {(): (0.0, -math.inf)}  # (blank, non-blank)
    for step in log_probs:
        grown: dict[tuple[int, ...], list[float]] = defaultdict(lambda: [-math.inf, -math.inf])
        for prefix, (p_blank, p_label) in beams.items():
            for c, p in enumerate(step):
                if c == blank:
                    grown[prefix][0] = _logsumexp(grown[prefix][0], p_blank + p, p_label + p)
                    continue
                longer = prefix + (c,)
                if prefix and prefix[-1] == c:  # a repeat extends only after a blank
                    grown[longer][1] = _logsumexp(grown[longer][1], p_blank + p)
                    grown[prefix][1] = _logsumexp(grown[prefix][1], p_label + p)
                else:
                    grown[longer][1] = _logsumexp(grown[longer][1], p_blank + p, p_label + p)
        ranked = sorted(grown.items(), key=lambda kv: _logsumexp(*kv[1]), reverse=True)
        beams = {prefix: (pb, pl) for prefix, (pb, pl) in ranked[:beam_width]}
    return sorted(((prefix, _logsumexp(*p)) for prefix, p in beams.items()),
                  key=lambda item: item[1], reverse=True)


def ctc_beam_search_decoder(probs: torch.Tensor, lengths: torch.Tensor, blank: int = 0,
                            beam_width: int = 100, top_paths: int = 1
                            ) -> list[torch.Tensor]:
    """The `top_paths` most likely label sequences of CTC log-probabilities `probs` [T, B, C].

    Returns [path log-probabilities [B, top_paths], path lengths [B, top_paths],
    paths [B, top_paths, T]] (paths padded with zeros after their length).
    """
    _check(isinstance(probs, torch.Tensor), "ctc_beam_search_decoder: probs must be a "
           f"torch.tensor argument. {type(probs)} is not supported.")
    _check(isinstance(lengths, torch.Tensor), "ctc_beam_search_decoder: lengths must be a "
           f"torch.tensor argument. {type(lengths)} is not supported.")
    if probs.dim() != 3 or lengths.shape != (probs.shape[1],):
        raise ValueError(f"ctc_beam_search_decoder: probs must be [input_length, batch_size, "
                         f"num_classes] and lengths [batch_size]; got {list(probs.shape)} and "
                         f"{list(lengths.shape)}")
    if not 1 <= top_paths <= beam_width:
        raise ValueError(f"ctc_beam_search_decoder: top_paths ({top_paths}) must be in "
                         f"[1, beam_width ({beam_width})]")
    steps, batch, _ = probs.shape
    out_probs = torch.full((batch, top_paths), -math.inf, dtype=probs.dtype)
    out_lengths = torch.zeros((batch, top_paths), dtype=torch.int32)
    out_paths = torch.zeros((batch, top_paths, steps), dtype=torch.int32)
    table = probs.detach().float().cpu()
    for b in range(batch):
        length = int(lengths[b])
        ranked = _beam_search(table[:length, b].tolist(), blank, beam_width)
        for k, (labels, log_p) in enumerate(ranked[:top_paths]):
            out_probs[b, k] = log_p
            out_lengths[b, k] = len(labels)
            out_paths[b, k, :len(labels)] = torch.tensor(labels, dtype=torch.int32)
    return [out_probs.to(probs.device), out_lengths.to(probs.device), out_paths.to(probs.device)]


def custom_op(inputs: Sequence[torch.Tensor], name: str, domain: str, domain_version: int,
              example_outputs: Sequence[torch.Tensor],
              attributes: dict[str, AttributeValue] | None = None) -> list[torch.Tensor]:
    """PopART custom operators are IPU programs; on CPU/GPU this raises IpuOnlyError."""
    raise IpuOnlyError(
        f"poptorch.custom_op({name!r}, domain={domain!r}) runs a PopART custom operator, a "
        "C++/Poplar program compiled for the IPU: it cannot run on CPU or GPU. Write the op in "
        "PyTorch instead (a function of torch ops, or a torch.autograd.Function for a custom "
        "gradient) and call it in forward; pipetorch runs it on the model's device")
