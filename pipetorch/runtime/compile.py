"""Preparing a model for its device: capture, partition, validate, place weights and optimiser."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from tqdm import tqdm

from pipetorch.errors import CompileError, ConfigError, Error
from pipetorch.partition import checks
from pipetorch.profiling import estimate
from pipetorch.partition.split import CaptureOnce
from pipetorch.partition.strategies import StageSpec
from pipetorch.partition import casting
from pipetorch.runtime import weight_files, weights
from pipetorch.runtime.batching import split_micro_batches, to_device
from pipetorch.partition.blocks import begin_blocks
from pipetorch.partition.probe import Capture, probe, probe_by_export
from pipetorch.partition.suspects import suspect
from pipetorch.enums import AutoStage
from pipetorch.parallel.compiled import CompiledStage
from pipetorch.parallel.local import FlatStage, LocalEngine, ReplicaBuffers
from pipetorch.runtime.weights import held
from pipetorch.runtime.config import RunConfig
from pipetorch.runtime.optimizer import device_optimizer

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass
class Compiled:
    """Everything a wrapper needs to run host calls."""

    engine: Any  # LocalEngine or parallel.engine.ProcessEngine
    stages: list[StageSpec]
    capture: Capture
    devices: int
    seconds: float
    synthetic: list[tuple[tuple, dict]] | None = None
    graph: CaptureOnce | None = None  # the whole-model capture, made when first needed


def _synthetic_like(micro_batches: list[tuple[tuple, dict]], device: torch.device) -> list:
    """Inputs of the compiled shapes made on the device: floats ~N(0,1), integers 0."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def make(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_floating_point():
            return torch.randn(x.shape, generator=gen, dtype=torch.float32).to(device, x.dtype)
        return torch.zeros(x.shape, dtype=x.dtype, device=device)

    return [torch.utils._pytree.tree_map(make, mb) for mb in micro_batches]


def compile_model(user_model: nn.Module, args: tuple, kwargs: dict, *, config: RunConfig,
                  training: bool, optimizer: torch.optim.Optimizer | None,
                  device: torch.device) -> Compiled:
    """Build the engine for `user_model`, validating the model against the options."""
    start = time.perf_counter()
    batching = config.batching
    bar = tqdm(total=4, desc="Graph compilation", unit="step", leave=False,
               disable=not config.progress_bar)
    shared = _host_copy_is_users(user_model, config)
    modes = {m: m.training for m in user_model.modules()}
    try:
        # Workers each receive their own stage: the host copy is then the user's model itself
        # (PopTorch's host copy), never a second one. One device keeps a private copy on it.
        model = user_model if shared else weights.device_copy(user_model, device)
        micro = split_micro_batches(args, kwargs, device_iterations=batching.device_iterations,
                                    gradient_accumulation=batching.gradient_accumulation,
                                    replication_factor=batching.replication_factor)
        first_args, first_kwargs = to_device(micro[0], torch.device("cpu") if shared else device)
        cast = casting.for_forward(model, first_args, first_kwargs, config.precision)
        strategy = config.strategy
        if config.balance_devices:
            with casting.within(cast):
                strategy = _auto_balance(model, first_args, first_kwargs, config)
        stored = _stored(model, first_args, first_kwargs, config, training=training)
        traced = None
        if stored is not None:
            capture = stored.probe
        elif _in_processes(_declared_devices(model, strategy), config):
            # Split for sure: the capture the split needs is the only forward run.
            model = model.to("cpu")  # the host copy; each worker moves its stage to its device
            capture, traced = _probe_by_export(model, to_device(micro[0], torch.device("cpu")),
                                               training=training, casting=cast)
        else:
            capture = probe(model, first_args, first_kwargs, training=training, casting=cast)
        bar.update()
        stages = strategy.resolve(capture.blocks, preamble=capture.ops_before_blocks)
        checks.check_batching(stages, pipelined=strategy.pipelined, training=training,
                            gradient_accumulation=batching.gradient_accumulation,
                            device_iterations=batching.device_iterations)
        devices = checks.device_count(stages, replication_factor=batching.replication_factor,
                                    auto_round=config.auto_round)
        bar.update()
        in_processes = _in_processes(len({s.ipu_id for s in stages}), config)
        if model is user_model and not in_processes:  # one device after all: its own copy
            model = weights.device_copy(user_model, device)
        # The host copy stays on the CPU when workers run the stages (each moves its own).
        host = torch.device("cpu") if in_processes else device
        model = model.to(host)
        first = to_device(micro[0], host)
        replica_buffers = _replica_buffers(model, capture, config)
        engine: Any
        bar.update()
        device_opt = (device_optimizer(optimizer, user_model, model,
                                       auto_loss_scaling=config.auto_loss_scaling,
                                       offload=config.offload) if training else None)
        # One capture for the estimate and the split, from the executable cache if enabled.
        # (A capture made for workers but not used by them was made on the CPU copy: not
        # reused for a model that stays on `device`.)
        graph = CaptureOnce(model, first, cache_dir=config.cache_dir, settings=config.settings,
                            casting=cast, probe=capture, stored=stored,
                            traced=traced if in_processes else None)
        with casting.within(cast):
            _check_memory(model, first, stages, config, optimizer=device_opt,
                          pipelined=strategy.pipelined, training=training, device=device,
                          capture=graph)
        recompute = training and config.recomputation
        backend = config.compile_backend
        if in_processes:
            from pipetorch.parallel.build import process_engine

            engine = process_engine(
                model, first, stages, batching=batching, optimizer=device_opt,
                writer=weight_files.output_of(user_model) if model is user_model else None,
                pipelined=strategy.pipelined, training=training, recomputation=recompute,
                process=config.process, seed=config.seed, capture=graph,
                compile_backend=backend, loss_index=capture.loss_index,
                pipeline_schedule=config.schedule)
        else:
            forward: Any = model
            if training and (capture.uses_recomputation or recompute):
                from pipetorch.parallel.recompute import stage_module

                forward = stage_module(model, checkpoint=recompute)
            if backend is not None:
                forward = CompiledStage(forward, backend)
            engine = LocalEngine(model, FlatStage(forward, micro[0], capture.output),
                                 optimizer=device_opt, batching=batching,
                                 replica_buffers=replica_buffers, loss_index=capture.loss_index,
                                 casting=cast)
        graph.save()  # the capture and what was measured from it, for the next run
        bar.update()
    finally:
        bar.close()
        for module, training_mode in modes.items():  # capturing set the wrapper's mode
            module.training = training_mode
    synthetic = _synthetic_like(micro, engine.input_device) if config.synthetic else None
    seconds = time.perf_counter() - start
    logger.info("Compiled %d stage(s) on %d logical device(s) in %.2fs", len(stages), devices, seconds)
    return Compiled(engine, stages, capture, devices, seconds, synthetic, graph)


def add_signature(compiled: Compiled, args: tuple, kwargs: dict, *, config: RunConfig,
                  training: bool, device: torch.device) -> tuple[int, list | None]:
    """Prepare `compiled`'s engine for one more input signature (Options.inputSignatures):
    forward captured (or read from the executable cache) and split into the same stages for
    these inputs, checked against the memory budget, and run by the same engine on the same
    weights and optimiser state. Returns the signature's number for `engine.use` and its
    synthetic inputs (enableSyntheticData)."""
    engine, batching = compiled.engine, config.batching
    model = engine.model  # the host copy (workers), or the device copy (one device)
    local = isinstance(engine, LocalEngine)
    modes = {m: m.training for m in model.modules()}
    micro = split_micro_batches(args, kwargs, device_iterations=batching.device_iterations,
                                gradient_accumulation=batching.gradient_accumulation,
                                replication_factor=batching.replication_factor)
    try:
        first = to_device(micro[0], engine.input_device)
        cast = casting.for_forward(model, *first, config.precision)
        stored = _stored(model, *first, config, training=training)
        traced = None
        if stored is not None:
            capture = stored.probe
        elif local:
            capture = probe(model, *first, training=training, casting=cast)
        else:
            capture, traced = _probe_by_export(model, first, training=training, casting=cast)
        graph = CaptureOnce(model, first, cache_dir=config.cache_dir, settings=config.settings,
                            casting=cast, probe=capture, stored=stored, traced=traced)
        with casting.within(cast):  # a longer sequence needs more memory than the first
            _check_memory(model, first, compiled.stages, config, optimizer=engine.optimizer,
                          pipelined=config.strategy.pipelined, training=training,
                          device=device, capture=graph)
        if local:
            key = engine.add_signature(FlatStage(engine.forward, first, capture.output),
                                       loss_index=capture.loss_index, casting=cast)
        else:
            from pipetorch.parallel.build import stage_graphs

            staged, routes, specs = stage_graphs(
                model, first, compiled.stages, training=training,
                recomputation=training and config.recomputation, capture=graph,
                compile_backend=config.compile_backend, loss_index=capture.loss_index)
            key = engine.add_signature(staged, routes, specs)
        graph.save()
    finally:
        for module, training_mode in modes.items():  # capturing set the wrapper's mode
            module.training = training_mode
    return key, _synthetic_like(micro, engine.input_device) if config.synthetic else None


def _host_copy_is_users(model: nn.Module, config: RunConfig) -> bool:
    """Whether the user's model can be the engine's host copy: its stages run in workers
    (known before forward runs), its tensors are in host memory, and nothing runs it
    eagerly before the split (opts.autoBalance measures a copy)."""
    if config.balance_devices or not _in_processes(_declared_devices(model, config.strategy),
                                                     config):
        return False
    return all(t.device.type == "cpu" for t in [*held(model, "_parameters").values(),
                                                 *held(model, "_buffers").values()])


def _stored(model: nn.Module, args: tuple, kwargs: dict, config: RunConfig, *,
            training: bool) -> Any:
    """The executable cache's entry for this call (cache.Stored), None without one: with it
    nothing runs forward before the first step."""
    if not config.cache_dir:
        return None
    from pipetorch.partition import cache

    model.train(training)  # the key holds the modes the capture was made in
    return cache.lookup(config.cache_dir, model, args, kwargs, settings=config.settings)


def _auto_balance(model: nn.Module, args: tuple, kwargs: dict, config: RunConfig) -> Any:
    """opts.autoBalance: place the model's stages by measured cost before capturing it; the
    strategy to run with (the options' own, or its kind over the balanced Block scopes)."""
    from pipetorch.profiling.balancing import balanced_strategy
    from pipetorch.schedule.devices import engine_kind

    budget = config.memory_budget
    return balanced_strategy(model, args, kwargs, devices=config.balance_devices,
                             strategy=config.strategy,
                             memory_budget=budget if isinstance(budget, int) else None,
                             schedule=engine_kind(config.strategy.pipelined, config.schedule),
                             micro_batches=config.batching.gradient_accumulation)


def _check_memory(model: nn.Module, first: tuple[tuple, dict], stages: list[StageSpec],
                  config: RunConfig, *, optimizer: torch.optim.Optimizer | None,
                  pipelined: bool, training: bool, device: torch.device,
                  capture: CaptureOnce | None = None) -> None:
    """Refuse, before any worker starts, a configuration whose estimate exceeds the budget."""
    budget = estimate.device_budget(config.memory_budget, device=device)
    if budget is None:  # CPU without a budget: no sizing forward
        return
    found = estimate.estimate_memory(
        model, first, stages, batching=config.batching, optimizer=optimizer,
        pipelined=pipelined, training=training, offload=config.offload,
        recomputation=config.recomputation, capture=capture, schedule=config.schedule)
    estimate.check_budget(found, budget)


def _probe_by_export(model: nn.Module, first: tuple[tuple, dict], *, training: bool,
                     casting: Any) -> tuple[Capture, Any]:
    """probe_by_export; where torch.export fails, or the capture shows a mistake only a real
    kernel notices (partition.suspects), an eager run says whether forward itself fails (then
    with its own error, as PyTorch raises it, retold by runtime.checks)."""
    try:
        capture, traced = probe_by_export(model, *first, training=training, casting=casting)
    except CompileError as failed:
        if isinstance(failed.__cause__, Error) or not isinstance(failed.__cause__, Exception):
            raise
        probe(model, *first, training=training, casting=casting)
        raise
    if suspect(traced.module.graph, traced.layout.flatten(*first)):
        probe(model, *first, training=training, casting=casting)  # raises torch's error
    return capture, traced


def _declared_devices(model: nn.Module, strategy: Any) -> int:
    """The devices known before forward runs: an explicit strategy's stages, else the model's
    BeginBlock annotations (blocks entered inside forward are found by running it)."""
    declared = strategy.stages
    if isinstance(declared, list) and declared:
        return len({i if s.ipu_id is None else s.ipu_id for i, s in enumerate(declared)})
    marks = list(begin_blocks(model).values())
    if declared is AutoStage.AutoIncrement:
        return max(1, len(marks))
    return len({0} | {ipu for _, ipu in marks if ipu is not None})


def _in_processes(devices: int, config: RunConfig) -> bool:
    """Whether stages on `devices` devices run in worker processes ($PIPETORCH_EXECUTION:
    auto, processes, local).

    auto: when there is more than one device (logical devices x replicas), or more than one
    host process (their replicas reduce gradients together).
    """
    mode, processes = config.execution, config.process[1]
    if processes > 1:
        if mode == "local":
            raise ConfigError(
                f"PIPETORCH_EXECUTION=local cannot run one of {processes} host processes: their "
                "replicas exchange gradients through stage workers; unset it")
        return True
    replicas = config.batching.replication_factor
    return mode == "processes" or (mode == "auto" and devices * replicas > 1)


def _replica_buffers(model: nn.Module, capture: Capture,
                     config: RunConfig) -> ReplicaBuffers | None:
    batching = config.batching
    if batching.replication_factor == 1 or not capture.mutated_buffers:
        return None
    if config.broadcast_buffers:
        raise ConfigError(
            f"The model changes buffers {capture.mutated_buffers[:4]} in forward (e.g. BatchNorm "
            f"running statistics) and replicationFactor is {batching.replication_factor}: "
            "replicas cannot share buffers they each update; call "
            "opts.broadcastBuffers(False) so each replica keeps its own")
    return ReplicaBuffers(model, capture.mutated_buffers, batching.replication_factor)
