"""`pipetorch plan MODEL`: each device's memory and the step time of a run, before the machines."""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["register", "load_model"]

_HELP = "predict each device's memory and the step time of a pipelined run, on the meta device"
_DESCRIPTION = """\
Plan a training run before having the machines: the model is built on the meta device (no
weight is allocated), one forward on fake tensors sizes each segment, and each device's
weights, gradients, optimiser state and activations x micro-batches in flight are priced
with the memory estimate pipetorch checks a real run against (poptorch.plan).

MODEL is a HuggingFace config.json (transformers is imported for this path only, lazily; the
model is AutoModelForCausalLM.from_config on the meta device, nothing downloaded) or
module:function returning a model, or (model, inputs) with inputs one micro-batch as a dict of
keyword tensors or (args, kwargs); the function may take micro_batch and sequence. A model
alone gets input_ids and labels of shape (micro-batch, sequence).

--json prints one object: schedule, stages, replicas, accumulation, cut (BeginBlock names
where stages 1.. begin), budget, fits, devices (per stage: parameters, buffers, gradients,
optimiser_state, activations, received, host_optimiser_state, in_flight, process, peak, fits,
segments; bytes), host, step_seconds, bubble, time_method, method, remedies (name, code,
saving, fits). Exit code 0 when the plan fits (or no --device-memory), 1 when it does not."""

_PREFIXES = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand to the `pipetorch` parser."""
    p = subparsers.add_parser("plan", help=_HELP, description=_DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="config.json, or module:function")
    p.add_argument("--machines", type=int, default=1)
    p.add_argument("--devices-per-machine", type=int, default=1)
    p.add_argument("--device-memory", help='bytes per device, e.g. "80GB" or "24GiB"')
    p.add_argument("--flops", help='sustained FLOP/s per device for the step time, e.g. '
                                   '"400T" or 4e14')
    p.add_argument("--measure-here", action="store_true",
                   help="time each segment's forward and backward, the optimiser step and "
                        "the transfers on this CPU for the step time, and add a worker "
                        "process's memory outside the model to each peak (CPU runs)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--sequence", type=int, default=1024)
    p.add_argument("--accumulation", type=int,
                   help="micro-batches per step (default: what keeps the bubble under 10%%)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd", "lamb"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--loss-scaling", type=float)
    p.add_argument("--recompute", action="store_true", help="recompute activations in backward")
    p.add_argument("--offload", action="store_true", help="optimiser state in host memory")
    p.add_argument("--sharded", action="store_true",
                   help="optimiser state sharded over the replicas (replicated tensor sharding)")
    p.add_argument("--schedule", default="auto", choices=("auto", "1f1b", "zero_bubble"))
    p.add_argument("--flash-attention", action="store_true",
                   help="size attention as a GPU's flash kernel keeps it (no scores)")
    p.add_argument("--split", nargs="+", metavar="NAME",
                   help="BeginBlock names where stages 1.. begin (default: chosen)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(command=_command, parser=p)


def _flops(text: str | None) -> float | None:
    if text is None:
        return None
    number, unit = (text[:-1], text[-1].upper()) if text[-1:].isalpha() else (text, "")
    try:
        return float(number) * _PREFIXES[unit]
    except (KeyError, ValueError):
        raise ValueError(f"--flops {text!r}: give a number, e.g. 4e14, or one with K, M, G, T "
                         "or P, e.g. 400T") from None


def _command(args: argparse.Namespace) -> int:
    import torch

    from pipetorch.options.ipu_setters import _budget_bytes
    from pipetorch.profiling.plan import plan

    try:
        memory = None if args.device_memory is None else _budget_bytes(
            "--device-memory", args.device_memory)
        model, inputs = load_model(args.model, dtype=getattr(torch, args.dtype),
                                   micro_batch=args.micro_batch, sequence=args.sequence)
        found = plan(model, inputs, devices=args.machines * args.devices_per_machine,
                     device_memory=memory, flops=_flops(args.flops),
                     accumulation=args.accumulation, replicas=args.replicas,
                     optimizer=args.optimizer, loss_scaling=args.loss_scaling,
                     recompute=args.recompute, offload=args.offload, sharded=args.sharded,
                     schedule=args.schedule, split=args.split, measure_here=args.measure_here,
                     flash_attention=args.flash_attention)
    except (ValueError, TypeError, ImportError, OSError) as error:
        args.parser.error(str(error))
    print(json.dumps(found.to_json(), indent=2) if args.json else found.table(), flush=True)
    return 0 if found.fits is not False else 1


def load_model(spec: str, *, dtype: torch.dtype, micro_batch: int,
               sequence: int) -> tuple[torch.nn.Module, tuple[tuple, dict]]:
    """(model, (args, kwargs) of one micro-batch) from a config.json or module:function."""
    import torch

    if spec.endswith(".json") or os.path.isdir(spec):
        model = _from_config(spec, dtype)
        inputs = None
    else:
        module, _, name = spec.partition(":")
        if not name:
            raise ValueError(f"MODEL {spec!r} is neither a config.json nor module:function")
        sys.path.insert(0, os.getcwd())
        function = getattr(importlib.import_module(module), name)
        wanted = inspect.signature(function).parameters
        made = function(**{k: v for k, v in (("micro_batch", micro_batch),
                                             ("sequence", sequence)) if k in wanted})
        model, inputs = made if isinstance(made, tuple) else (made, None)
        if dtype != torch.float32:
            model = model.to(dtype)
    if inputs is None:
        device = next(model.parameters()).device
        ids = torch.zeros(micro_batch, sequence, dtype=torch.long, device=device)
        inputs = ((), {"input_ids": ids, "labels": ids})
    elif isinstance(inputs, dict):
        inputs = ((), inputs)
    return model, inputs


def _from_config(path: str, dtype: torch.dtype) -> torch.nn.Module:
    """A HuggingFace model from its config.json, built on the meta device."""
    import torch
    import transformers  # only here: the library itself never imports transformers

    path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(path, encoding="utf-8") as file:
        fields = json.load(file)
    if "model_type" not in fields:
        raise ValueError(f"{path} has no model_type: not a HuggingFace config.json")
    config = transformers.AutoConfig.for_model(**fields)
    config.use_cache = False
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError:  # not a causal language model
            return transformers.AutoModel.from_config(config, dtype=dtype)
