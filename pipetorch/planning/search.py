"""The layouts a model's training may take on its devices, each planned, those that fit ranked
by predicted step time (`plan(..., search=True)`, `pipetorch plan --search`).

A layout is a number of pipeline stages x replicas, a schedule (1F1B or zero-bubble, one
stage on each device: stages x replicas the devices; interleaved, two stages on each device
round-robin; none for one stage), the optimiser state kept whole, sharded over the replicas
or offloaded to the host, and recomputation on or off. Every layout trains the same
samples per step: the given (or proposed) gradient accumulation of one replica, divided over
the replicas. Each is planned as `plan` plans one: the cut balanced by the model's own
segment costs within the budget, each device's peak priced, the step simulated. The model is
measured once for all of them. Of the ways to save memory, each stages x replicas and
schedule keeps the cheapest that fits (sharding before offload, both before recomputation):
the others take as long or longer (recomputation runs each forward again) and are not
listed; when none fits, the last one tried says by how much.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from pipetorch.partition import balance
from pipetorch.planning.estimate import fmt
from pipetorch.planning.layout_plan import Measured, plan_measured
from pipetorch.planning.planned import Plan
from pipetorch.planning.stage_devices import SCHEDULES, kind_of, owners, per_device, refusal

__all__ = ["Layout", "Considered", "Search", "search"]

# where the optimiser state lives, cheapest first: on the device whole, sharded over the
# replicas, in host memory
_STATE = ("whole", "sharded", "offloaded")


@dataclass(frozen=True)
class Layout:
    """One way to lay the run over the devices."""

    stages: int
    replicas: int
    schedule: str          # "1f1b", "zero_bubble", "interleaved", or "none" (one stage)
    state: str             # "whole", "sharded" (over the replicas) or "offloaded" (to the host)
    recompute: bool
    accumulation: int      # micro-batches per step on each replica

    @property
    def devices(self) -> int:
        """Devices of one replica's pipeline (interleaved: half its stages)."""
        return self.stages // per_device(kind_of(self.schedule))

    def describe(self) -> str:
        """'2 stages x 1 replica, 1f1b, G 8' ('4 stages on 2 devices x 1 replica,
        interleaved, G 8') and what saves memory."""
        words = [f"{self.stages} stage{'s' * (self.stages > 1)}"
                 + (f" on {self.devices} devices" if self.devices < self.stages else "")
                 + f" x {self.replicas} replica{'s' * (self.replicas > 1)}",
                 self.schedule if self.stages > 1 else "no pipeline", f"G {self.accumulation}"]
        if self.state != "whole":
            words.append(f"optimiser state {self.state}")
        if self.recompute:
            words.append("recomputation")
        return ", ".join(words)


@dataclass(frozen=True)
class Considered:
    """A layout and its plan (None where it cannot run), and why it is left out ("" if not)."""

    layout: Layout
    plan: Plan | None
    reason: str = ""


@dataclass(frozen=True)
class Search:
    """The layouts that fit, fastest first, and the others with their reasons."""

    model: str
    devices: int
    budget: int | None
    fitting: tuple[Considered, ...]
    refused: tuple[Considered, ...]

    def code(self, rank: int = 1) -> list[str]:
        """The `rank`-th fastest layout (the fastest by default) as the Options and BeginBlock
        lines that set it up, for a model named `model` and `import pipetorch as poptorch`
        ([] when fewer layouts fit)."""
        if not 1 <= rank <= len(self.fitting):
            return []
        best = self.fitting[rank - 1]
        assert best.plan is not None
        layout = best.layout
        lines = ["opts = poptorch.Options()"]
        if layout.replicas > 1:
            lines.append(f"opts.replicationFactor({layout.replicas})")
        lines.append(f"opts.Training.gradientAccumulation({layout.accumulation})")
        if layout.schedule not in ("1f1b", "none"):
            lines.append(f'opts.Training.pipelineSchedule("{layout.schedule}")')
        if layout.recompute:
            lines.append("opts.Training.setRecomputation(True)")
        if layout.state != "whole":
            setting = ("useReplicatedTensorSharding(True)" if layout.state == "sharded" else
                       "useOnChipStorage(False)")
            lines.append("opts.TensorLocations.setOptimizerLocation("
                         f"poptorch.TensorLocationSettings().{setting})")
        for name, ipu in zip(best.plan.cut, best.plan.owners[1:], strict=True):
            path = python_path(name)
            lines.append(f"{path} = poptorch.BeginBlock({path}, ipu_id={ipu})")
        return lines

    def to_json(self) -> dict[str, Any]:
        """The search as a JSON-ready dict (bytes and seconds)."""
        def entry(c: Considered, rank: int | None) -> dict[str, Any]:
            layout, found = c.layout, c.plan
            return {"rank": rank, "stages": layout.stages, "devices": layout.devices,
                    "replicas": layout.replicas,
                    "schedule": layout.schedule, "optimiser_state": layout.state,
                    "recompute": layout.recompute, "accumulation": layout.accumulation,
                    "step_seconds": found.step_seconds if found else None,
                    "bubble": found.bubble if found else None,
                    "peak": max(found.peaks.values()) if found else None,
                    "cut": list(found.cut) if found else None, "reason": c.reason or None}
        return {"model": self.model, "devices": self.devices, "budget": self.budget,
                "layouts": [entry(c, rank) for rank, c in enumerate(self.fitting, 1)],
                "refused": [entry(c, None) for c in self.refused], "code": self.code()}

    def table(self) -> str:
        """The search as text: the fitting layouts ranked, the others' reasons, the code."""
        lines = [f"model {self.model} on {self.devices} device(s)"
                 + (f" of {fmt(self.budget)}" if self.budget is not None else "")
                 + f": {len(self.fitting)} layout(s) fit, {len(self.refused)} do not"]
        for rank, c in enumerate(self.fitting, 1):
            assert c.plan is not None and c.plan.step_seconds is not None
            lines.append(f"  {rank:>2}. {c.plan.step_seconds:8.3f} s/step (bubble "
                         f"{c.plan.bubble:.0%}), fullest device {fmt(max(c.plan.peaks.values()))}"
                         f": {c.layout.describe()}; cut: {', '.join(c.plan.cut) or 'none'}")
        if self.refused:
            lines.append("do not fit or cannot run:")
            lines += [f"  - {c.layout.describe()}: {c.reason}" for c in self.refused]
        if self.fitting:
            lines.append("the fastest, with `model` your model and `import pipetorch as "
                         "poptorch`:")
            lines += [f"  {line}" for line in self.code()]
        return "\n".join(lines)


def python_path(name: str) -> str:
    """A module's dotted name as Python reaching it from `model`: 'transformer.h.6' ->
    'model.transformer.h[6]'."""
    path = "model"
    for part in name.split("."):
        path += f"[{part}]" if part.isdigit() else f".{part}" if part.isidentifier() else (
            f"[{part!r}]")
    return path


def layouts(devices: int, accumulation: int) -> list[list[Layout]]:
    """Every layout of `devices`, each replica accumulating its share of `accumulation`
    (one replica's micro-batches per step), where that share is whole: for each pipeline of
    devices x replicas and schedule (its stages on those devices), its ways of saving
    memory, the cheapest first (the state whole, sharded, offloaded; then each again with
    recomputation)."""
    found = []
    for replicas in (r for r in range(1, devices + 1) if devices % r == 0):
        pipeline = devices // replicas
        share, rest = divmod(accumulation, replicas)
        if rest or not share:
            continue
        states = _STATE if replicas > 1 else ("whole", "offloaded")
        for schedule in list(SCHEDULES) if pipeline > 1 else ["none"]:
            stages = len(owners(kind_of(schedule), pipeline))
            found.append([Layout(stages, replicas, schedule, state, recompute, share)
                          for recompute, state in itertools.product((False, True), states)])
    return found


def search(found: Measured, *, devices: int, device_memory: int | None,
           accumulation: int | None, min_elements: int) -> Search:
    """Every layout of `devices` for the model `found` measured, planned (see the module)."""
    total = accumulation or _proposed(devices)
    fitting: list[Considered] = []
    refused: list[Considered] = []
    for ways in layouts(devices, total):  # the cheapest way that fits: the others cost more
        for layout in ways:
            considered = _consider(found, layout, device_memory, min_elements)
            if not considered.reason or considered.plan is None:
                break
        (refused if considered.reason else fitting).append(considered)
    if not fitting and not refused:
        raise ValueError(f"accumulation {total} divides over no replica count of {devices} "
                         "devices")

    def cost(c: Considered) -> float:
        assert c.plan is not None and c.plan.step_seconds is not None
        return c.plan.step_seconds
    return Search(found.model, devices, device_memory, tuple(sorted(fitting, key=cost)),
                  tuple(refused))


def _proposed(devices: int) -> int:
    """One replica's micro-batches per step when none is given: what keeps the deepest
    pipeline's bubble under 10%, rounded up to divide over every replica count."""
    g = balance.propose_gradient_accumulation(devices)
    return -(-g // devices) * devices


def _consider(found: Measured, layout: Layout, device_memory: int | None,
              min_elements: int) -> Considered:
    why = refusal(kind_of(layout.schedule), layout.devices, len(found.pieces),
                  layout.accumulation)
    if why:
        return Considered(layout, None, why)
    planned = plan_measured(found, devices=layout.devices, replicas=layout.replicas,
                            device_memory=device_memory, accumulation=layout.accumulation,
                            recompute=layout.recompute, offload=layout.state == "offloaded",
                            sharded=layout.state == "sharded", schedule=layout.schedule
                            if layout.stages > 1 else "auto", min_elements=min_elements,
                            remedies=False)
    if planned.fits is False:
        assert device_memory is not None
        device, peak = max(planned.peaks.items(), key=lambda kv: kv[1])
        return Considered(layout, planned, f"device {device} peaks at {fmt(peak)}, over the "
                          f"{fmt(device_memory)} of a device by {fmt(peak - device_memory)}")
    return Considered(layout, planned)
