"""`pipetorch plan MODEL`: each device's memory and the step time of a run, before the machines."""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = ["register", "load_model"]

_HELP = "predict each device's memory and the step time of a pipelined run, on the meta device"
_DESCRIPTION = """\
Plan a training run before having the machines: the model is built on the meta device (no
weight is allocated), one forward on fake tensors sizes each segment, and each device's
weights, gradients, optimiser state and activations x micro-batches in flight are priced
with the memory estimate pipetorch checks a real run against (poptorch.plan).

MODEL is a HuggingFace config.json (transformers is imported for this path only, lazily; the
model is built from the config on the meta device, nothing downloaded: the class its
architectures names, else a sequence-to-sequence head for an encoder-decoder (T5, BART), a
masked language model for an encoder (BERT), a causal one (GPT-2, Llama), an image classifier
(ViT), or the bare model) or module:function returning a model, or (model, inputs) with inputs
one micro-batch as a dict of keyword tensors or (args, kwargs); the function may take
micro_batch and sequence. A model alone gets input_ids of shape (micro-batch, sequence), and
decoder_input_ids and labels where its forward takes them (pixel_values of the config's
image_size for an image model).

--schedule interleaved puts 2 stages on each device of a pipeline of P = devices / replicas
devices, round-robin (stage s of 2P on device s % P, as BeginBlock(..., ipu_id=s % P) and
Training.pipelineSchedule("interleaved") run it; --split then names 2P - 1 places): each
device's memory is its two stages' sum. It needs 2P segments and an --accumulation of 4P - 1
or more that its rounds split evenly (the default is raised to one).

--json prints one object: model (its class), schedule, stages, replicas, accumulation, cut
(BeginBlock names where stages 1.. begin), budget, fits, devices (per device: device, stages,
segments (each stage's), parameters, buffers, gradients, optimiser_state, activations,
received, host_optimiser_state, in_flight, process, peak, fits; bytes), host, step_seconds,
bubble, time_method, method, remedies (name, code, saving, fits).

--search plans every layout of the devices (stages x replicas, 1F1B, zero-bubble or
interleaved, optimiser state whole, sharded or offloaded, recomputation; the samples per step
kept, --accumulation being one replica's) and lists those that fit by predicted step time,
then the others with their reasons, then the fastest as the Options and BeginBlock lines that
set it up; with --json: layouts, refused and code. It needs --flops or --measure-here.

Exit code 0 when the plan fits (or no --device-memory), 1 when it does not (with --search:
when no layout fits), 2 for a run that cannot happen (e.g. --accumulation below
2 x stages - 1 for a pipeline, a --sequence longer than the config's positions), in one line
naming the flag."""

_SEQUENCE = 1024  # tokens per sample unless --sequence, or the config, says fewer
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
    p.add_argument("--sequence", type=int,
                   help="tokens per sample (default: 1024, or the config's positions if fewer)")
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
    p.add_argument("--schedule", default="auto",
                   choices=("auto", "1f1b", "zero_bubble", "interleaved"),
                   help="the pipeline schedule (default: the fastest that fits); interleaved "
                        "puts 2 stages on each device, stage s on device s %% devices")
    p.add_argument("--flash-attention", action="store_true",
                   help="size attention as a GPU's flash kernel keeps it (no scores)")
    p.add_argument("--split", nargs="+", metavar="NAME",
                   help="BeginBlock names where stages 1.. begin (default: chosen)")
    p.add_argument("--search", action="store_true",
                   help="plan every layout of the devices (stages x replicas, schedule, "
                        "optimiser state whole, sharded or offloaded, recomputation) and rank "
                        "those that fit by step time; needs --flops or --measure-here")
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


def _check(args: argparse.Namespace) -> None:
    """Refuse, in the flags' words, what no run can have: sizes below 1, replicas that do
    not divide the devices, fewer micro-batches than the pipeline needs."""
    from pipetorch.partition.stage_rules import min_gradient_accumulation

    for flag in ("machines", "devices_per_machine", "replicas", "micro_batch", "sequence"):
        value, name = getattr(args, flag), "--" + flag.replace("_", "-")
        if value is not None and value < 1:
            raise ValueError(f"{name} {value}: give {name} 1 or more")
    if args.search:
        chosen = [flag for flag, given in (
            ("--replicas", args.replicas != 1), ("--recompute", args.recompute),
            ("--offload", args.offload), ("--sharded", args.sharded),
            ("--schedule", args.schedule != "auto"), ("--split", args.split is not None))
            if given]
        if chosen:
            raise ValueError(f"--search chooses {', '.join(chosen)} itself: leave "
                             f"{'it' if len(chosen) == 1 else 'them'} out")
        if not (args.flops or args.measure_here):
            raise ValueError("--search ranks layouts by their step time: give --flops (e.g. "
                             "400T) or --measure-here")
    devices = args.machines * args.devices_per_machine
    if devices % args.replicas:
        raise ValueError(f"--replicas {args.replicas} does not divide the {devices} devices "
                         "(--machines x --devices-per-machine): each replica is a pipeline of "
                         "devices / replicas stages; give a --replicas that divides them")
    stages = devices // args.replicas
    least = min_gradient_accumulation(stages) if stages > 1 and not args.search else 1
    if args.accumulation is not None and args.accumulation < least:
        if least == 1:
            raise ValueError(f"--accumulation {args.accumulation}: give --accumulation 1 or "
                             "more (micro-batches per step)")
        raise ValueError(
            f"--accumulation {args.accumulation} is below {least}, the fewest micro-batches "
            f"pipelined training over {stages} stages runs (2 x stages - 1: each stage runs a "
            f"forward and later a backward); give --accumulation {least} or more, or fewer "
            "stages")


def _memory(text: str | None) -> int | None:
    """--device-memory in bytes."""
    from pipetorch.options.ipu_setters import _budget_bytes

    if text is None:
        return None
    try:
        return _budget_bytes("--device-memory", int(text) if text.isdigit() else text)
    except ValueError:
        raise ValueError(f"--device-memory {text!r}: give the bytes of one device, more than "
                         "0: a number or a size such as 80GB or 24GiB (B, KB, MB, GB, TB in "
                         "powers of 1000; KiB, MiB, GiB, TiB in powers of 1024)") from None


def _command(args: argparse.Namespace) -> int:
    import torch

    from pipetorch.planning.layout_plan import TooManyStagesError
    from pipetorch.planning.plan import plan
    from pipetorch.planning.search import Search

    try:
        _check(args)
        memory = _memory(args.device_memory)
        model, inputs = load_model(args.model, dtype=getattr(torch, args.dtype),
                                   micro_batch=args.micro_batch, sequence=args.sequence)
        found = plan(model, inputs, devices=args.machines * args.devices_per_machine,
                     device_memory=memory, flops=_flops(args.flops),
                     accumulation=args.accumulation, replicas=args.replicas,
                     optimizer=args.optimizer, loss_scaling=args.loss_scaling,
                     recompute=args.recompute, offload=args.offload, sharded=args.sharded,
                     schedule=args.schedule, split=args.split, measure_here=args.measure_here,
                     flash_attention=args.flash_attention, search=args.search)
    except TooManyStagesError as error:
        args.parser.error(
            f"{error.stages} stages (--machines x --devices-per-machine / --replicas) but "
            f"{args.model} has {len(error.segments)} segments a stage may hold "
            f"({', '.join(error.segments)}); plan at most {len(error.segments)} stages: fewer "
            "--devices-per-machine or --machines, or more --replicas")
    except (ValueError, TypeError, ImportError, OSError) as error:
        args.parser.error(str(error))
    print(json.dumps(found.to_json(), indent=2) if args.json else found.table(), flush=True)
    if isinstance(found, Search):
        return 0 if found.fitting else 1
    return 0 if found.fits is not False else 1


def load_model(spec: str, *, dtype: torch.dtype, micro_batch: int,
               sequence: int | None) -> tuple[torch.nn.Module, tuple[tuple, dict]]:
    """(model, (args, kwargs) of one micro-batch) from a config.json or module:function;
    `sequence` None is 1024, or the config's positions if fewer."""
    import torch

    if spec.endswith(".json") or os.path.isdir(spec):
        model, inputs = _from_config(spec, dtype), None
    else:
        model, inputs = _from_function(spec, micro_batch=micro_batch,
                                       sequence=sequence or _SEQUENCE)
        if dtype != torch.float32:
            model = model.to(dtype)
    if inputs is None:
        inputs = ((), _inputs(model, micro_batch, sequence))
    elif isinstance(inputs, dict):
        inputs = ((), inputs)
    return model, inputs


def _from_function(spec: str, **sizes: int) -> tuple[torch.nn.Module, Any]:
    """(model, inputs or None) from module:function, called with the sizes it takes."""
    import torch

    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"MODEL {spec!r} is neither a config.json nor module:function")
    sys.path.insert(0, os.getcwd())
    try:
        function = getattr(importlib.import_module(module), name, None)
    except ModuleNotFoundError as error:
        if error.name is None or not module.startswith(error.name):
            raise  # the module imports something missing: its own message says what
        raise ValueError(f"MODEL {spec!r}: no module {module!r} in {os.getcwd()} or on "
                         "sys.path; give module:function of a .py file there or of an "
                         "installed module") from None
    if not callable(function):
        raise ValueError(f"MODEL {spec!r}: module {module} has no function {name!r}; give "
                         "module:function naming a function that returns a model")
    wanted = inspect.signature(function).parameters
    made = function(**{k: v for k, v in sizes.items() if k in wanted})
    model, inputs = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"MODEL {spec!r}: {name}() returned {type(made).__name__}, not a "
                         "torch.nn.Module; return the model, or (model, inputs)")
    return model, inputs


def _inputs(model: torch.nn.Module, micro_batch: int, sequence: int | None) -> dict:
    """One micro-batch for a model that came alone: pixel_values of the config's image_size
    for an image model, else input_ids of `sequence` tokens (refused beyond the config's
    positions); decoder_input_ids and labels where forward takes them."""
    import torch

    config: Any = getattr(model, "config", None)
    weight = next(iter(model.parameters()), torch.zeros(()))
    wanted = inspect.signature(model.forward).parameters
    kind = getattr(model, "main_input_name", "input_ids")
    whole = "Classification" in type(model).__name__ and "Token" not in type(model).__name__
    if kind == "pixel_values":
        side = config.image_size
        height, width = (side, side) if isinstance(side, int) else side
        inputs = {kind: torch.zeros(micro_batch, config.num_channels, height, width,
                                    dtype=weight.dtype, device=weight.device)}
        labels = torch.zeros(micro_batch, dtype=torch.long, device=weight.device)
    elif kind == "input_ids":
        field, limit = _positions(config)
        if sequence is not None and limit is not None and sequence > limit:
            raise ValueError(f"--sequence {sequence} is longer than {type(model).__name__}'s "
                             f"position table ({field} {limit} in its config); give "
                             f"--sequence {limit} or less")
        sequence = sequence or min(_SEQUENCE, limit or _SEQUENCE)
        ids = torch.zeros(micro_batch, sequence, dtype=torch.long, device=weight.device)
        inputs = {kind: ids}
        if "decoder_input_ids" in wanted and getattr(config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = ids
        labels = ids[:, 0] if whole else ids
    else:
        raise ValueError(f"{type(model).__name__} takes {kind}, which plan does not make; "
                         "give module:function returning (model, inputs)")
    if "labels" in wanted or config is None:  # a model of one's own: as before, labels too
        inputs["labels"] = labels
    return inputs


def _positions(config: PretrainedConfig | None) -> tuple[str, int | None]:
    """The config's position table: (its field, its length), None for relative positions."""
    for field in ("n_positions", "max_position_embeddings"):
        if isinstance(getattr(config, field, None), int):
            return field, getattr(config, field)
    return "", None


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
        return _model_class(transformers, config, path)._from_config(config, dtype=dtype)


def _model_class(transformers: types.ModuleType, config: PretrainedConfig, path: str) -> Any:
    """The class the config's architectures names, else its task's head: sequence to
    sequence for an encoder-decoder, causal LM for a decoder, else masked LM (BERT),
    causal LM (GPT-2), image classification (ViT), or the bare model."""
    named = getattr(config, "architectures", None) or []
    for name in named:
        if hasattr(transformers, name):
            return getattr(transformers, name)
    if named:
        raise ValueError(f"{path}: architectures {named} names no class of transformers "
                         f"{transformers.__version__}; remove architectures to plan the "
                         "config's usual head, or name one of its classes")
    order = ["MASKED_LM", "CAUSAL_LM", "IMAGE_CLASSIFICATION"]
    if getattr(config, "is_encoder_decoder", False):  # transformers 5: not on every config
        order.insert(0, "SEQ_TO_SEQ_CAUSAL_LM")
    elif getattr(config, "is_decoder", False):
        order.insert(0, "CAUSAL_LM")
    mappings = [getattr(transformers, f"MODEL_FOR_{task}_MAPPING") for task in order]
    for mapping in [*mappings, transformers.MODEL_MAPPING]:
        if type(config) in mapping:
            return mapping[type(config)]
    raise ValueError(f"{path}: transformers {transformers.__version__} has no model for "
                     f"{getattr(config, 'model_type', type(config).__name__)}; give "
                     "module:function returning the model")
