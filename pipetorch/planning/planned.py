"""The planned run (`Plan`, what `plan` returns for one layout): its cut, schedule, each
device's memory and the step time, as a table or JSON-ready dict."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipetorch.planning.estimate import MemoryEstimate, Remedy, fmt

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """The planned run: its cut, schedule, each device's memory and the step time. Its
    stages sit on the devices as `owners` says (interleaved: stage s of 2P on device s % P);
    `estimate.devices`, `peaks` and `temporaries` are by device, each its stages' sum."""

    estimate: MemoryEstimate
    names: tuple[str, ...]           # each stage's first and last segment, "first .. last"
    cut: tuple[str, ...]             # the BeginBlock names where stages 1.. begin
    schedule: str                    # "1f1b", "zero_bubble", "interleaved", or "none" (one stage)
    replicas: int
    accumulation: int
    budget: int | None               # bytes per device
    overhead: int                    # bytes per worker process outside the model (measured here)
    temporaries: dict[int, int]      # per device: the CPU step's temporaries (measured runs only)
    remedies: tuple[Remedy, ...]
    step_seconds: float | None
    bubble: float
    time_method: str
    host_weights: int
    model: str                       # the model's class, e.g. "BertForMaskedLM"
    transient: dict[int, int] = field(default_factory=dict)  # per device: `_transients` (measured)
    heap: dict[int, int] = field(default_factory=dict)  # per device: `_heap` (measured runs)

    @property
    def peaks(self) -> dict[int, int]:
        """Each device's peak: its tensors; measured here, a CPU worker's, with its process,
        its backward's transient, its step's temporaries, its heap's high-water and,
        offloaded, its optimiser state (a CPU worker's host memory is its own)."""
        return {ipu: d.total + self.transient.get(ipu, 0) + self.overhead
                + self.temporaries.get(ipu, 0) + self.heap.get(ipu, 0)
                + (d.host_optimiser_state if self.overhead else 0)
                for ipu, d in self.estimate.devices.items()}

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else max(self.peaks.values()) <= self.budget

    @property
    def owners(self) -> tuple[int, ...]:
        """Each stage's device: the ipu_id of the BeginBlock where it begins."""
        return tuple(stage.ipu for stage in self.estimate.stages)

    def _held(self, ipu: int) -> str:
        """The segments of device `ipu`'s stage, or "s: segments" of each where it holds
        several."""
        stages = self.estimate.devices[ipu].stages
        return "; ".join(self.names[s] if len(stages) == 1 else f"{s}: {self.names[s]}"
                         for s in stages)

    def to_json(self) -> dict[str, Any]:
        """The plan as a JSON-ready dict (bytes and seconds)."""
        devices = [{"device": ipu, "stages": list(d.stages),
                    "segments": [self.names[s] for s in d.stages], **d.categories,
                    "host_optimiser_state": d.host_optimiser_state, "in_flight": d.in_flight,
                    "process": self.overhead,
                    "step_temporaries": self.temporaries.get(ipu, 0),
                    "backward_transient": self.transient.get(ipu, 0),
                    "heap": self.heap.get(ipu, 0), "peak": self.peaks[ipu],
                    "fits": None if self.budget is None else self.peaks[ipu] <= self.budget}
                   for ipu, d in self.estimate.devices.items()]
        return {"model": self.model, "schedule": self.schedule, "stages": len(self.names),
                "replicas": self.replicas,
                "accumulation": self.accumulation, "cut": list(self.cut),
                "budget": self.budget, "fits": self.fits, "devices": devices,
                "host": {"weights": self.host_weights, "optimiser_state": sum(
                    d.host_optimiser_state for d in self.estimate.devices.values())},
                "step_seconds": self.step_seconds, "bubble": self.bubble,
                "time_method": self.time_method, "method": self.estimate.method,
                "remedies": [{"name": r.name, "code": r.code, "saving": r.saving,
                              "fits": r.fits} for r in self.remedies]}

    def table(self) -> str:
        """The plan as text: one row per device, then the cut, the step time, the remedies."""
        heads = ["device", "weights", "gradients", "optimiser", "activations", "in flight",
                 "peak", "fits", "segments"]
        rows = [heads]
        for ipu, d in self.estimate.devices.items():
            fits = "-" if self.budget is None else (
                "yes" if self.peaks[ipu] <= self.budget else
                f"NO (+{fmt(self.peaks[ipu] - self.budget)})")
            rows.append([str(ipu), fmt(d.parameters + d.buffers), fmt(d.gradients),
                         fmt(d.optimiser_state) + (f" (+{fmt(d.host_optimiser_state)} host)"
                                                   if d.host_optimiser_state else ""),
                         fmt(d.activations + d.received + self.transient.get(ipu, 0)),
                         str(d.in_flight), fmt(self.peaks[ipu]), fits, self._held(ipu)])
        widths = [max(len(r[i]) for r in rows) for i in range(len(heads))]
        lines = [f"model {self.model}"]
        lines += ["  ".join(c.rjust(w) if 0 < i < len(heads) - 1 else c.ljust(w)
                            for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                  for r in rows]
        devices, stages = len(rows) - 1, len(self.names)
        lines.append(f"schedule {self.schedule}, {stages} stages"
                     + (f" on {devices} devices (stage s on device s % {devices})"
                        if stages > devices else "")
                     + f" x {self.replicas} replicas, gradient accumulation "
                     f"{self.accumulation}; cut: " + (", ".join(self.cut) or "none"))
        if self.overhead:
            lines.append(f"peaks include {fmt(self.overhead)} per worker process outside the "
                         "model (a worker with torch and the model's libraries, measured here), "
                         "the step's temporaries (two of the device's largest parameter: "
                         + ", ".join(fmt(t) for t in self.temporaries.values()) + ") and the "
                         "heap's high-water (the small activations again: "
                         + ", ".join(fmt(h) for h in self.heap.values()) + ")")
        if self.budget is not None:
            lines.append(f"budget {fmt(self.budget)} per device: "
                         + ("fits" if self.fits else "does NOT fit"))
        if self.step_seconds is not None:
            lines.append(f"predicted step: {self.step_seconds:.3f} s (bubble "
                         f"{self.bubble:.0%}; {self.time_method})")
        for rank, r in enumerate(self.remedies, 1):
            if rank == 1:
                lines.append("what would make it fit, by what each saves on the fullest device:")
            lines.append(f"  {rank}. {r.name}: saves {fmt(r.saving)}; "
                         + ("fits on its own" if r.fits else "not enough on its own"))
            lines.append(f"       {r.code}")
        return "\n".join(lines)
