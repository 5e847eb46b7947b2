"""Compiling a model for its devices: capture forward, partition it into stages, plan where
and how they run (validated against the options), then start the engine the plan names."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from tqdm import tqdm

from pipetorch.errors import CompileError, ConfigError, Error
from pipetorch.planning import estimate
from pipetorch.partition.split import CaptureOnce
from pipetorch.partition.strategies import ExecutionStrategy, StageSpec
from pipetorch.partition import casting, op_log, stage_rules
from pipetorch.partition.casting import Casting
from pipetorch.weights import files as weight_files, host_copy
from pipetorch.runtime.batching import split_micro_batches, to_device
from pipetorch.partition.blocks import begin_blocks
from pipetorch.partition.probe import Capture, modes_kept, probe, probe_by_export
from pipetorch.partition.suspects import suspect
from pipetorch.enums import AutoStage
from pipetorch.parallel.host.build import plan_stages, stage_graphs
from pipetorch.parallel.layout.compile_plan import CompilePlan
from pipetorch.parallel.worker.compiled import CompiledStage
from pipetorch.parallel.host.engines import Engine
from pipetorch.parallel.host.local import FlatStage, LocalEngine, ReplicaBuffers
from pipetorch.weights.host_copy import held
from pipetorch.runtime.config import RunConfig
from pipetorch.runtime.optimizer import device_optimizer

if TYPE_CHECKING:
    from pipetorch.partition.cache import Stored
    from pipetorch.partition.trace import Traced

__all__: list[str] = []

logger = logging.getLogger(__name__)

CPU = torch.device("cpu")


@dataclass
class Compiled:
    """Everything a wrapper needs to run host calls: the engine, the plan it started from and
    what capturing forward found."""

    engine: Engine
    plan: CompilePlan
    capture: Capture
    seconds: float
    synthetic: list[tuple[tuple, dict]] | None = None
    graph: CaptureOnce | None = None  # the whole-model capture, made when first needed

    @property
    def stages(self) -> tuple[StageSpec, ...]:
        """The plan's stages."""
        return self.plan.stages

    @property
    def devices(self) -> int:
        """The logical devices the plan needs."""
        return self.plan.devices


def _synthetic_like(micro_batches: list[tuple[tuple, dict]], device: torch.device) -> list:
    """Inputs of the compiled shapes made on the device: floats ~N(0,1), integers 0."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def make(x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            return torch.randn(x.shape, generator=gen, dtype=torch.float32).to(device, x.dtype)
        return torch.zeros(x.shape, dtype=x.dtype, device=device)

    return [torch.utils._pytree.tree_map_only(torch.Tensor, make, mb) for mb in micro_batches]


def compile_model(user_model: nn.Module, args: tuple, kwargs: dict, *, config: RunConfig,
                  training: bool, optimizer: torch.optim.Optimizer | None,
                  device: torch.device) -> Compiled:
    """Build the engine for `user_model`, validating the model against the options."""
    start = time.perf_counter()
    batching = config.batching
    bar = tqdm(total=4, desc="Graph compilation", unit="step", leave=False,
               disable=not config.progress_bar)
    with modes_kept(user_model), bar:  # capturing sets the wrapper's mode
        # Capture: forward once, on the host copy (on the CPU when workers are known to run
        # the stages, else on `device`).
        model, host = _host_copy(user_model, config, device=device)
        micro = split_micro_batches(args, kwargs, batching)
        first = to_device(micro[0], host)
        cast = casting.for_forward(model, *first, config.half_float_casting)
        strategy = config.strategy
        if config.balance_devices:
            with casting.within(cast):
                strategy = _auto_balance(model, *first, config)
        workers = _in_processes(_declared_devices(model, strategy), config)
        if _host(workers, device) != host:  # opts.autoBalance measured its copy on `device`
            model, first = _on_host(model, user_model, micro[0], workers=workers, device=device)
        graph = capture_forward(model, first, config, training=training, casting=cast,
                                export=workers)
        found = graph.probe
        assert found is not None  # capture_forward always probes
        bar.update()
        # Partition: the strategy's stages of the blocks forward entered.
        stages, devices = _partition(found, strategy, config, training=training)
        _log_placement(found, stages, strategy)
        bar.update()
        # Plan: where the stages run, checked against the memory budget, then the engine.
        in_processes = _in_processes(len({s.ipu_id for s in stages}), config)
        if in_processes != workers:  # forward entered blocks its annotations did not declare
            model, first = _on_host(model, user_model, micro[0], workers=in_processes,
                                    device=device)
            graph = graph.moved(model, first)
        replica_buffers = _replica_buffers(model, found, config)
        bar.update()
        device_opt = None
        if training:
            assert optimizer is not None  # trainingModel makes one
            device_opt = device_optimizer(optimizer, user_model, model,
                                          auto_loss_scaling=config.auto_loss_scaling,
                                          offload=config.offload)
        with casting.within(cast):
            _check_memory(model, first, stages, config, optimizer=device_opt,
                          pipelined=strategy.pipelined, training=training, device=device,
                          capture=graph)
        recompute = training and config.recomputation
        plan = plan_stages(model, first, stages, devices=devices, in_processes=in_processes,
                           replicas=batching.replication_factor, pipelined=strategy.pipelined,
                           pipeline_schedule=config.schedule, training=training,
                           recomputation=recompute, capture=graph,
                           compile_backend=config.compile_backend,
                           loss_index=found.loss_index)
        if plan.local:
            engine: Engine = _local_engine(model, micro[0], found, config, training=training,
                                        optimizer=device_opt, casting=cast,
                                        replica_buffers=replica_buffers)
        else:
            from pipetorch.parallel.host.engine import ProcessEngine

            engine = ProcessEngine(
                model, plan, batching=batching, optimizer=device_opt, process=config.process,
                seed=config.seed, sharding=config.sharding, across=config.across,
                writer=weight_files.output_of(user_model) if model is user_model else None)
        graph.save()  # the capture and what was measured from it, for the next run
        bar.update()
    synthetic = _synthetic_like(micro, engine.input_device) if config.synthetic else None
    seconds = time.perf_counter() - start
    logger.info("Compiled %d stage(s) on %d logical device(s) in %.2fs", len(stages), devices,
                seconds)
    return Compiled(engine, plan, found, seconds, synthetic, graph)


def add_signature(compiled: Compiled, args: tuple, kwargs: dict, *, config: RunConfig,
                  training: bool, device: torch.device) -> tuple[int, list | None]:
    """Prepare `compiled`'s engine for one more input signature (Options.inputSignatures):
    forward captured (or read from the executable cache) and split into the same stages for
    these inputs, checked against the memory budget, and run by the same engine on the same
    weights and optimiser state. Returns the signature's number for `engine.use` and its
    synthetic inputs (enableSyntheticData)."""
    engine, batching, local = compiled.engine, config.batching, compiled.plan.local
    model = engine.model  # the host copy (workers), or the device copy (one device)
    stages = list(compiled.stages)
    micro = split_micro_batches(args, kwargs, batching)
    with modes_kept(model):  # capturing sets the wrapper's mode
        first = to_device(micro[0], engine.input_device)
        cast = casting.for_forward(model, *first, config.half_float_casting)
        graph = capture_forward(model, first, config, training=training, casting=cast,
                                export=not local)
        found = graph.probe
        assert found is not None  # capture_forward always probes
        with casting.within(cast):  # a longer sequence needs more memory than the first
            _check_memory(model, first, stages, config, optimizer=engine.optimizer,
                          pipelined=config.strategy.pipelined, training=training,
                          device=device, capture=graph)
        if local:
            assert isinstance(engine, LocalEngine)  # the plan's engine
            key = engine.add_signature(FlatStage(engine.forward, first, found.output),
                                       loss_index=found.loss_index, casting=cast)
        else:
            from pipetorch.parallel.host.engine import ProcessEngine

            assert isinstance(engine, ProcessEngine)  # the plan's engine
            graphs = stage_graphs(
                model, first, stages, training=training,
                recomputation=training and config.recomputation, capture=graph,
                compile_backend=config.compile_backend, loss_index=found.loss_index)
            key = engine.add_signature(graphs.staged, graphs.routes, graphs.specs)
        graph.save()
    return key, _synthetic_like(micro, engine.input_device) if config.synthetic else None


def capture_forward(model: nn.Module, first: tuple[tuple, dict], config: RunConfig, *,
                    training: bool, casting: Casting | None, export: bool) -> CaptureOnce:
    """`model`'s forward captured for `first` (one micro-batch on the model's device), with
    what the probe found in it; the one place deciding how: from the executable cache's entry
    when it holds one (forward runs zero times), else by torch.export when `export` (the
    stages run in workers: the split needs that capture, the only forward run), else by one
    eager forward (partition.probe)."""
    stored = _stored(model, *first, config, training=training)
    traced = None
    if stored is not None:
        found = stored.probe
    elif export:
        found, traced = _probe_by_export(model, first, training=training, casting=casting)
    else:
        found = probe(model, *first, training=training, casting=casting)
    return CaptureOnce(model, first, cache_dir=config.cache_dir, settings=config.settings,
                       casting=casting, probe=found, stored=stored, traced=traced)


def _log_placement(found: Capture, stages: list[StageSpec],
                   strategy: ExecutionStrategy) -> None:
    """PopTorch's DEBUG lines: whether the stages pipeline, and each op's device and stage."""
    if op_log.wanted():
        pipelined = int(strategy.pipelined and len(stages) > 1)
        op_log.logger.debug("Popart option enablePipelining set to value %d", pipelined)
        for line in op_log.placement_lines(getattr(found, "ops", ()), stages, strategy):
            op_log.logger.debug(line)


def _partition(found: Capture, strategy: ExecutionStrategy, config: RunConfig, *,
               training: bool) -> tuple[list[StageSpec], int]:
    """The stages `strategy` makes of the blocks forward entered, checked against the
    batching, and the logical devices they need."""
    batching = config.batching
    stages = strategy.resolve(found.blocks, preamble=found.ops_before_blocks)
    stage_rules.check_batching(stages, pipelined=strategy.pipelined, training=training,
                          gradient_accumulation=batching.gradient_accumulation,
                          device_iterations=batching.device_iterations)
    return stages, stage_rules.device_count(stages, replication_factor=batching.replication_factor,
                                       auto_round=config.auto_round)


def _host_copy(user_model: nn.Module, config: RunConfig, *,
               device: torch.device) -> tuple[nn.Module, torch.device]:
    """The engine's host copy and the device it is on. Where workers run the stages (known
    before forward runs) it is the user's model itself when that is in host memory (PopTorch's
    host copy: never a second one), else a private copy on the CPU (each worker moves its own
    stage); otherwise a private copy on `device`, as for opts.autoBalance, which measures its
    copy there."""
    workers = not config.balance_devices and _in_processes(
        _declared_devices(user_model, config.strategy), config)
    if workers and _in_host_memory(user_model):
        return user_model, CPU
    host = _host(workers, device)
    return host_copy.device_copy(user_model, host), host


def _in_host_memory(model: nn.Module) -> bool:
    """Whether every parameter and buffer of `model` is in host memory (read without the
    accessors that would fetch the device's weights first)."""
    return all(t.device.type == "cpu" for t in [*held(model, "_parameters").values(),
                                                *held(model, "_buffers").values()])


def _host(workers: bool, device: torch.device) -> torch.device:
    """Where the host copy lives: the CPU when workers run the stages, else `device`."""
    return CPU if workers else device


def _on_host(model: nn.Module, user_model: nn.Module, micro: tuple[tuple, dict], *,
             workers: bool, device: torch.device) -> tuple[nn.Module, tuple[tuple, dict]]:
    """The host copy moved to where the stages run, learnt after it was made, and the
    micro-batch `micro` there: the CPU for workers, else `device` (a private copy there when
    the host copy was the user's model)."""
    host = _host(workers, device)
    if model is user_model and not workers:
        model = host_copy.device_copy(user_model, device)
    return model.to(host), to_device(micro, host)


def _local_engine(model: nn.Module, micro: tuple[tuple, dict], found: Capture,
                  config: RunConfig, *, training: bool,
                  optimizer: torch.optim.Optimizer | None, casting: Casting | None,
                  replica_buffers: ReplicaBuffers | None) -> LocalEngine:
    """The engine running `model` (on its device) in this process: forward recomputed
    (recomputationCheckpoint, Training.setRecomputation) and compiled (compileStages) as the
    options ask."""
    recompute = training and config.recomputation
    forward: nn.Module = model
    if training and (found.uses_recomputation or recompute):
        from pipetorch.parallel.worker.recompute import stage_module

        forward = stage_module(model, checkpoint=recompute)
    if config.compile_backend is not None:
        forward = CompiledStage(forward, config.compile_backend)
    return LocalEngine(model, FlatStage(forward, micro, found.output), optimizer=optimizer,
                       batching=config.batching, replica_buffers=replica_buffers,
                       loss_index=found.loss_index, casting=casting)


def _stored(model: nn.Module, args: tuple, kwargs: dict, config: RunConfig, *,
            training: bool) -> Stored | None:
    """The executable cache's entry for this call (cache.Stored), None without one: with it
    nothing runs forward before the first step."""
    if not config.cache_dir:
        return None
    from pipetorch.partition import cache

    model.train(training)  # the key holds the modes the capture was made in
    return cache.lookup(config.cache_dir, model, args, kwargs, settings=config.settings)


def _auto_balance(model: nn.Module, args: tuple, kwargs: dict,
                  config: RunConfig) -> ExecutionStrategy:
    """opts.autoBalance: place the model's stages by measured cost before capturing it; the
    strategy to run with (the options' own, or its kind over the balanced Block scopes)."""
    from pipetorch.planning.balancing import balanced_strategy
    from pipetorch.schedule.device_plans import engine_kind

    budget, devices = config.memory_budget, config.balance_devices
    assert devices  # called only for opts.autoBalance
    return balanced_strategy(model, args, kwargs, devices=devices,
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
        recomputation=config.recomputation, capture=capture, schedule=config.schedule,
        sharding=config.sharding)
    estimate.check_budget(found, budget)


def _probe_by_export(model: nn.Module, first: tuple[tuple, dict], *, training: bool,
                     casting: Casting | None) -> tuple[Capture, Traced]:
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


def _declared_devices(model: nn.Module, strategy: ExecutionStrategy) -> int:
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
        raise ConfigError(  # PopTorch's words first
            "PopTorch does not support broadcasting buffers. If your model is able to tolerate "
            "buffers becoming out of sync between replicas, you can disable buffer "
            "broadcasting using poptorch.Options.broadcastBuffers(False). "
            f"The model changes buffers {capture.mutated_buffers[:4]} in forward (e.g. BatchNorm "
            f"running statistics) and replicationFactor is {batching.replication_factor}: "
            "replicas cannot share buffers they each update; call "
            "opts.broadcastBuffers(False) so each replica keeps its own")
    return ReplicaBuffers(model, capture.mutated_buffers, batching.replication_factor)
