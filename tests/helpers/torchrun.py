"""Two torchrun "machines" on 127.0.0.1, one process each, running a job script."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(script: str | Path, out: Path, *args: str, env: dict[str, str] | None = None,
              timeout: float = 300) -> list[dict[str, Any]]:
    """Run `script OUT ARGS...` as node 0 and node 1 of one torchrun job; what each process
    saved as OUT/process{p}.pt (both must exit 0)."""
    port = free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(script), str(out), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})}) for n in range(2)]
    try:
        logs = [node.communicate(timeout=timeout)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(logs)
    return [torch.load(out / f"process{p}.pt", weights_only=False) for p in range(2)]
