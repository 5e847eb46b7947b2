"""A stage's worker process: joins the stages' process group, then serves the host's commands."""
from __future__ import annotations

import importlib
import datetime
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from pipetorch.parallel import placement as places
from pipetorch.parallel import wire
from pipetorch.parallel.routes import Constant, Route, TensorSpec
from pipetorch.parallel.stage import Call, StageExecutor
from pipetorch.parallel.transport import PeerLink, backend_for
from pipetorch.partition.split import Source
from pipetorch.schedule import plans

__all__: list[str] = []

_WATCH_PERIOD = 0.25  # seconds between checks that the host process is still there


@dataclass(frozen=True)
class Setup:
    """Everything a worker needs, sent once as its first message."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    route: Route
    inputs: tuple[Source, ...]
    specs: dict[Source, TensorSpec | Constant]
    schedule: str              # plans.KINDS: "pipelined" or "sharded"
    devices: tuple[str, ...]   # every stage's device, by stage


@dataclass(frozen=True)
class Launch:
    """The small arguments a worker is started with."""

    placement: places.Placement
    world_size: int
    store: str        # file for torch.distributed's FileStore rendezvous
    timeout: float
    host_pid: int


def _die_with_parent(parent: int) -> None:
    """Exit when the process that started this worker is gone, even mid-transfer.

    (PR_SET_PDEATHSIG would fire when the *thread* that started the worker ends, which
    kills the workers of a wrapper built in a short-lived thread.)
    """
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_WATCH_PERIOD)
        os._exit(0)

    threading.Thread(target=watch, name="pipetorch-parent-watch", daemon=True).start()


class Worker:
    """Holds the stage and answers commands: run, pull, push, hyper, stop."""

    def __init__(self, launch: Launch, setup: Setup) -> None:
        self.launch, self.setup = launch, setup
        self.device = torch.device(launch.placement.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.module = setup.module.to(self.device)
        self.optimizer = setup.optimizer
        backend, staged = backend_for([torch.device(d) for d in setup.devices])
        wire_device = torch.device("cpu") if staged else self.device
        if self.optimizer is not None:
            _move_state(self.optimizer, self.device)
            # Global-norm clipping needs the squared norms of every stage's gradients.
            self.optimizer._pipetorch_reduce = (  # type: ignore[attr-defined]
                lambda t: _all_reduce_sum(t.to(wire_device)).to(t.device))
        dist.init_process_group(backend, init_method=f"file://{launch.store}",
                                rank=setup.route.index, world_size=launch.world_size,
                                timeout=datetime.timedelta(seconds=launch.timeout))
        link = PeerLink(device=self.device, wire_device=wire_device, timeout=launch.timeout)
        self.executor = StageExecutor(self.module, setup.route, setup.specs, inputs=setup.inputs,
                                      link=link, device=self.device, optimizer=self.optimizer)
        self._plans: dict[tuple[int, bool], list] = {}
        if self.optimizer is not None:
            # torch.optim imports torch._dynamo on the first zero_grad/step (seconds): pay it
            # while compiling, not inside the first training call.
            importlib.import_module("torch._dynamo")

    def handle(self, kind: str, payload: Any) -> Any:
        return getattr(self, f"_{kind}")(payload)

    def _run(self, payload: tuple[Call, bool]) -> Any:
        call, training = payload
        key = (call.micro_batches, training)
        if key not in self._plans:
            whole = plans.plan(self.setup.schedule, self.setup.route.stages, call.micro_batches,
                               training=training)
            self._plans[key] = whole[self.setup.route.index]
        call = Call({i: x.to(self.device, non_blocking=True) for i, x in call.inputs.items()},
                    call.iterations, call.micro_batches, call.wanted, call.scale)
        self.executor.run(self._plans[key], call, training=training)
        return self.executor.outputs, self.executor.trace

    def _pull(self, payload: None) -> Any:
        state = {n: t.detach().to("cpu", copy=True) for n, t in
                 [*self.module.named_parameters(), *self.module.named_buffers()]}
        optimizer_state: dict[str, dict[str, Any]] = {}
        if self.optimizer is not None:
            for name, param in self.module.named_parameters():
                if param in self.optimizer.state:
                    optimizer_state[name] = {
                        k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                        for k, v in self.optimizer.state[param].items()}
        return state, optimizer_state

    @torch.no_grad()
    def _push(self, state: dict[str, torch.Tensor]) -> None:
        for name, tensor in [*self.module.named_parameters(), *self.module.named_buffers()]:
            tensor.copy_(state[name])

    def _hyper(self, payload: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
        groups, attributes = payload
        assert self.optimizer is not None
        for group, values in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(values)
        for name, value in attributes.items():
            setattr(self.optimizer, name, value)

    def _stop(self, payload: None) -> None:
        return None


def _all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def _move_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim():
                state[key] = value.to(param.device)


def _failure(launch: Launch, executor: StageExecutor | None, exc: BaseException) -> wire.Failure:
    action, micro = None, None
    if executor is not None and executor.current is not None:
        step, base = executor.current
        action = step.kind.value
        micro = base + step.micro_batch if step.micro_batch is not None else None
    return wire.Failure(launch.placement.stage, launch.placement.device, os.getpid(), action,
                        micro, f"{type(exc).__name__}: {exc}", traceback.format_exc())


def main(conn: Connection) -> None:
    """Serve the host on `conn` until it says stop or goes away."""
    parent = os.getppid()
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the host's to handle
    launch, setup = wire.receive(conn, timeout=wire.timeout_seconds(), parent=parent)
    torch.set_num_threads(launch.placement.threads)
    record = places.register(launch.placement, host_pid=launch.host_pid)
    worker: Worker | None = None
    try:
        try:
            worker = Worker(launch, setup)
            wire.send(conn, ("ok", os.getpid()))
        except Exception as exc:
            wire.send(conn, ("error", _failure(launch, None, exc)))
        broken = worker is None
        while True:
            kind, payload = wire.receive(conn, timeout=float("inf"), parent=parent)
            if kind == "stop":
                wire.send(conn, ("ok", None))
                break
            if broken or worker is None:
                continue  # after a failure only "stop" (or being killed) ends the worker
            try:
                wire.send(conn, ("ok", worker.handle(kind, payload)))
            except Exception as exc:
                wire.send(conn, ("error", _failure(launch, worker.executor, exc)))
                broken = True
    except (EOFError, OSError, TimeoutError):
        pass  # the host has gone: nothing left to serve
    finally:
        record.unlink(missing_ok=True)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


if __name__ == "__main__":
    # python -m pipetorch.parallel.worker FD: FD is this end of a socket pair with the host.
    main(Connection(socket.socket(fileno=int(sys.argv[1])).detach()))
