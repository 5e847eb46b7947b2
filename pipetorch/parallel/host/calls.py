"""A process engine's host calls: each worker's inputs laid out in its shared-memory arena,
one Run message each, and the replies' outputs and trace spans collected."""
from __future__ import annotations

import dataclasses
import time
from typing import cast

import torch

from pipetorch import environment
from pipetorch.parallel.comm import arena, wire
from pipetorch.parallel.comm import messages as m
from pipetorch.parallel.host.engines import MicroBatches
from pipetorch.parallel.host.host_link import Kind
from pipetorch.parallel.host.local import reduction_multiplier
from pipetorch.parallel.host.outputs import Collector
from pipetorch.parallel.host.pipeline import Current
from pipetorch.parallel.host.weight_sync import WeightSync
from pipetorch.parallel.host.workers import WorkerSet
from pipetorch.parallel.comm.payloads import Call, Span, Trace
from pipetorch.partition.split import Source, StagedModel, map_leaves
from pipetorch.schedule.plans import Batching

__all__: list[str] = []


class Calls:
    """Runs `pipeline`'s training and inference calls on `workers` (`sync` keeps the weights);
    per worker, an arena for its inputs and one for its outputs (shared memory, see arena.py).
    Each call's traces are returned; `peak_memory`: stage -> its worker's peak so far (the
    CUDA allocator's on a GPU, resident memory on a CPU)."""

    def __init__(self, pipeline: Current, workers: WorkerSet, sync: WeightSync, *,
                 batching: Batching, num_processes: int) -> None:
        self.pipeline, self.workers, self.sync = pipeline, workers, sync
        self.batching, self.num_processes = batching, num_processes
        self.arenas: list[tuple[arena.Arena, arena.Arena]] = []
        self.peak_memory: dict[int, int] = {}

    def restart(self) -> None:
        """New workers: new arenas."""
        self.close()
        self.arenas = [(arena.Arena(), arena.Arena()) for _ in self.pipeline.now.placements]

    def close(self) -> None:
        """Release the inputs' memory files (the workers' mappings keep theirs)."""
        for inputs, outputs in self.arenas:
            inputs.close()
            outputs.close()
        self.arenas = []

    def train(self, micro_batches: MicroBatches, collector: Collector) -> list[Trace]:
        """D optimiser steps of G micro-batches on each replica (laid out [D][G][R])."""
        b, now = self.batching, self.pipeline.now
        assert self.sync.optimizer is not None and len(micro_batches) == b.micro_batches
        # the replicas summing gradients: every process's, or (one pipeline over the
        # processes) this process's, which hold all of them
        every = dataclasses.replace(b, replication_factor=now.replicas * (
            1 if now.spread else self.num_processes))
        return self._run(micro_batches, collector, training=True,
                         iterations=b.device_iterations, per_iteration=b.gradient_accumulation,
                         scale=reduction_multiplier(every))

    def infer(self, micro_batches: MicroBatches, collector: Collector) -> list[Trace]:
        """Forward of every micro-batch of the call, each replica through one plan."""
        return self._run(micro_batches, collector, training=False, iterations=1,
                         per_iteration=len(micro_batches) // self.pipeline.now.replicas,
                         scale=1.0)

    def _run(self, micro_batches: MicroBatches, collector: Collector, *,
             training: bool, iterations: int, per_iteration: int, scale: float) -> list[Trace]:
        """Send replica r the micro-batches r, r + R, r + 2R, ... and collect what comes back."""
        if training:
            self.sync.return_state()
        try:
            replies, arrivals, flat, wanted = self._exchange(
                micro_batches, collector, training=training, iterations=iterations,
                per_iteration=per_iteration, scale=scale)
        except KeyboardInterrupt:
            self.workers.interrupt()
            raise
        return self._collect(replies, arrivals, flat, wanted, collector)

    def _exchange(self, micro_batches: MicroBatches, collector: Collector, *,
                  training: bool, iterations: int, per_iteration: int, scale: float
                  ) -> tuple[list[m.RunReply], list[wire.Transfer], list, frozenset[int]]:
        """Send every worker its inputs and wait for all replies."""
        e, sync, workers = self.pipeline.now, self.sync, self.workers
        replicas = e.replicas
        flat = [e.staged.flatten_inputs(*args, **kwargs) for args, kwargs in micro_batches]
        if workers.link is not None:  # the same inputs on every process, or none trains
            named = list(zip(input_names(e.staged), zip(*flat, strict=True), strict=True))
            workers.across(lambda link: link.call(named))
        steps = len(flat) // replicas  # micro-batches per replica, in order: d * G + g
        wanted = frozenset(j for j in range(steps) if collector.wants(j))
        commit = sync.points.workers + 1
        save = training and sync.snapshots.wanted()
        overlap = self._overlap()  # read per call: a change between calls counts
        if training:
            # a host write not uploaded is superseded by this call: the host copy reads the
            # workers' weights, all of one call (docs/precision.md), never its written pages
            sync.refresh()
        start = time.perf_counter()
        # no peers once stopped after a failure: the gather below says what happened
        for n, (peer, placement) in enumerate(zip(workers.peers, e.placements, strict=False)):
            reads = sorted({i for s in placement.stages for i in e.routes[s].host_inputs})
            mine = flat[placement.replica::replicas]
            packed, views = self.arenas[n][0].lay_out(
                [((len(mine), *mine[0][i].shape), mine[0][i].dtype) for i in reads])
            with torch.no_grad():
                for i, view in zip(reads, views, strict=True):
                    torch.stack([f[i] for f in mine], out=view)  # straight into shared memory
            call = Call({}, iterations, per_iteration, wanted, scale, overlap)
            workers.send(peer, m.Run(call, training, commit if save else None, packed))
        arrivals: list[wire.Transfer] = []
        replies = workers.gather("a training call" if training else "an inference call",
                                   transfers=arrivals)
        assert all(isinstance(r, m.RunReply) for r in replies)
        runs = cast(list[m.RunReply], replies)
        if training:
            written = [t.snapshot for r in runs for t in r.traces if t.snapshot]
            sync.points.changed(saved=bool(written))
            sync.snapshots.called(time.perf_counter() - start, (
                max(s for s, _ in written), sum(b for _, b in written)) if written else None)
        return runs, arrivals, flat, wanted

    def _overlap(self) -> bool:
        """Whether replicas start their gradient buckets during the last backward
        (PIPETORCH_OVERLAP; `auto`: between GPUs)."""
        setting = environment.get("overlap")
        if setting == "auto":
            return all(torch.device(p.device).type == "cuda"
                       for p in self.pipeline.now.placements)
        return setting == "1"

    def _collect(self, replies: list[m.RunReply], arrivals: list[wire.Transfer], flat: list,
                 wanted: frozenset[int], collector: Collector) -> list[Trace]:
        """Unpack the workers' replies, hand the outputs to `collector`; their traces."""
        e = self.pipeline.now
        replicas = e.replicas
        outputs: dict[tuple[int, int], dict[int, list[object]]] = {}  # (replica, stage) -> m
        traces: list[Trace] = []
        for n, (placement, reply, arrival) in enumerate(zip(e.placements, replies, arrivals,
                                                             strict=True)):
            packed, device_traces = reply.packed, reply.traces
            by_stage = arena.unpack_tree(self.arenas[n][1], reply.outputs, packed)
            outputs.update({(placement.replica, s): o for s, o in by_stage.items()})
            # device to host: the reply and its outputs copied out of shared memory, on the
            # device's first stage
            nbytes = arrival.nbytes + sum(arena.nbytes(p) for p in packed.places)
            device_traces[0].spans.append(Span("D2H", None, arrival.start, time.monotonic_ns(),
                                               nbytes))
            traces += device_traces
            for trace in device_traces:
                if trace.peak_memory is not None:
                    self.peak_memory[trace.stage] = max(trace.peak_memory,
                                                        self.peak_memory.get(trace.stage, 0))
        if self.workers.link is not None:  # the other processes' stages' outputs
            for theirs in self.workers.across(
                    lambda link: link.exchange(Kind.OUTPUTS, outputs)).values():
                outputs.update(cast(dict, theirs))
        for j in sorted(wanted):
            for replica in range(replicas):
                micro = j * replicas + replica

                def fetch(source: Source, micro: int = micro, replica: int = replica,
                          j: int = j) -> object:
                    if source.kind == "input":
                        return flat[micro][source[1]]
                    stage = source[1]
                    index = e.routes[stage].host_outputs.index(source)
                    return outputs[replica, stage][j][index]

                collector.add(j, replica, map_leaves(e.staged.output, Source, fetch))
        return sorted(traces, key=lambda t: (t.replica, t.stage))


def input_names(staged: StagedModel) -> list[str]:
    """The names of a call's flat inputs: forward's argument names, with the leaf's place for
    an argument holding several tensors (`batch[1]`)."""
    layout = staged.layout
    return [name if name not in layout.nested else f"{name}[{n}]" for name in layout.tensors
            for n in range(layout.nested[name].num_leaves if name in layout.nested else 1)]
