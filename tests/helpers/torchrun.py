"""Two torchrun "machines" on 127.0.0.1, one process each, running a job script."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(script: str | Path, out: Path, *args: str, env: dict[str, str] | None = None,
              timeout: float = 300, dies: int | None = None) -> list[dict[str, Any]]:
    """Run `script OUT ARGS...` as node 0 and node 1 of one torchrun job; what each process
    saved as OUT/process{p}.pt (both must exit 0, but node `dies`, whose result is {})."""
    port = free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(script), str(out), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})}) for n in range(2)]
    try:
        if dies is not None:  # the survivor's torchrun waits for the dead node's at its end
            nodes[dies].wait(timeout=timeout)
            _scripts_ended(nodes[1 - dies].pid, timeout)
            nodes[1 - dies].kill()
        logs = [node.communicate(timeout=timeout)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert dies is not None or [node.returncode for node in nodes] == [0, 0], "\n".join(logs)
    found = [out / f"process{p}.pt" for p in range(2)]
    return [torch.load(f, weights_only=False) if f.exists() or p != dies else {}
            for p, f in enumerate(found)]


def _scripts_ended(agent: int, timeout: float) -> None:
    """Wait until torchrun's agent `agent` has no child left (its script's process)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            kids = "".join(p.read_text() for p in Path(f"/proc/{agent}/task").glob("*/children"))
        except OSError:
            return
        if not kids.split():
            return
        time.sleep(0.1)
