"""`plan`: each device's memory and the step time of a pipelined run before having the
machines, for one layout (`layout_plan.py`: how a model is measured once and each layout
priced and timed) or, `search=True`, for every layout the devices allow, ranked
(`search.py`)."""
from __future__ import annotations

import torch.nn as nn

from pipetorch.parallel.worker.sharded_step import DEFAULT_MIN_ELEMENTS
from pipetorch.partition.stage_rules import min_gradient_accumulation
from pipetorch.planning.layout_plan import measured, plan_measured
from pipetorch.planning.planned import Plan
from pipetorch.planning.search import Search, search as find

__all__ = ["plan", "Plan", "Search"]


def plan(model: nn.Module, inputs: tuple[tuple, dict], *, devices: int = 1,
         device_memory: int | None = None, flops: float | None = None,
         accumulation: int | None = None, replicas: int = 1, optimizer: str = "adamw",
         loss_scaling: float | None = None, recompute: bool = False, offload: bool = False,
         sharded: bool = False, schedule: str = "auto", split: list[str] | None = None,
         measure_here: bool = False, flash_attention: bool = False,
         min_elements: int = DEFAULT_MIN_ELEMENTS, search: bool = False) -> Plan | Search:
    """Plan training `model` (on the meta device or any other) on `devices` devices of
    `device_memory` bytes each: `replicas` pipelines of devices / replicas stages, one
    micro-batch being `inputs` (args, kwargs), `accumulation` micro-batches per step (default:
    what keeps the bubble under 10%). `split` names the BeginBlock places where stages 1..
    begin; without it the balancer chooses the cut. `schedule` is "1f1b", "zero_bubble",
    "interleaved" or "auto" (the fastest that fits, of those that can run). Interleaved puts
    two stages on each of the devices / replicas = P devices of a pipeline, round-robin
    (stage s of 2P on device s % P, `split` then naming 2P - 1 places), and needs 2P segments
    and an `accumulation` of 4P - 1 or more that its rounds split evenly (the default is
    raised to one); `Plan.peaks` are then each device's, the sum of its two stages. `sharded` shards the optimiser state over the replicas
    (replicated tensor sharding: that of weights over `min_elements` elements, as
    minElementsForReplicatedTensorSharding), `offload` keeps it in host memory. The step time needs a
    rate: `flops` (sustained FLOP/s per device) or `measure_here` (each segment timed for
    real on this CPU, which also measures a worker's memory outside the model). `flash_attention` sizes
    attention as a GPU's flash kernel keeps it (`measure`).

    `search=True` plans every layout of the `devices` instead (`search.search`): stages x
    replicas, schedule, sharded or offloaded optimiser state, recomputation, the samples per
    step kept (`accumulation` is a one-replica layout's); `replicas`, `recompute`, `offload`,
    `sharded`, `schedule` and `split` are then the search's to choose and must be left as
    they are. It needs a rate (`flops` or `measure_here`) to rank them."""
    if search and (replicas != 1 or recompute or offload or sharded or schedule != "auto"
                   or split is not None):
        raise ValueError("search=True chooses the replicas, recomputation, offload, sharding, "
                         "schedule and split itself: leave them out")
    if search and not (flops or measure_here):
        raise ValueError("search=True ranks layouts by their step time: give flops (FLOP/s "
                         "per device) or measure_here=True")
    if devices < 1 or replicas < 1 or devices % replicas:
        raise ValueError(f"devices ({devices}) must be a positive multiple of replicas "
                         f"({replicas}): each replica is a pipeline of devices / replicas stages")
    stages = devices // replicas
    least = min_gradient_accumulation(stages) if stages > 1 else 1
    if accumulation is not None and accumulation < (1 if search else least):
        raise ValueError(f"accumulation ({accumulation}) must be >= {least}"
                         + (f" (2*stages-1) for pipelined training with {stages} stages; "
                            "raise it or plan fewer stages" if stages > 1 else ""))
    found = measured(model, inputs, workers=devices, stages=1 if search else stages, flops=flops,
                     optimizer=optimizer, loss_scaling=loss_scaling, measure_here=measure_here,
                     flash_attention=flash_attention)
    if search:
        return find(found, devices=devices, device_memory=device_memory,
                    accumulation=accumulation, min_elements=min_elements)
    return plan_measured(found, devices=devices // replicas, replicas=replicas,
                         device_memory=device_memory, accumulation=accumulation,
                         recompute=recompute, offload=offload, sharded=sharded,
                         schedule=schedule, split=split, min_elements=min_elements)
