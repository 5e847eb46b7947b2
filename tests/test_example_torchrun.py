"""The torchrun recipes of docs/machines.md run as written: two "machines" on 127.0.0.1."""
from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

from helpers.reference import plain_train_call
from helpers.torchrun import free_port

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "machines.md"
BASH = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)

# Every script a torchrun recipe of the page starts, and the test that runs it with 2 nodes.
RECIPES = {
    "examples/torchrun/train.py":
        "tests/test_example_torchrun.py::test_train_py_keeps_the_processes_weights_equal",
    "examples/torchrun/pipeline.py":
        "tests/test_example_torchrun.py::test_pipeline_py_trains_like_plain_pytorch",
    "tests/parallel/torchrun_saving_job.py":
        "tests/parallel/test_cross_process.py::"
        "test_a_pipeline_over_two_processes_saves_each_stage_on_its_process",
    "tests/parallel/torchrun_sharded_job.py":
        "tests/parallel/test_sharded_step.py::"
        "test_two_torchrun_processes_shard_over_their_own_replicas",
}


def torchrun_blocks() -> list[str]:
    """The page's bash blocks that start torchrun."""
    return [b for b in BASH.findall(PAGE.read_text()) if "torchrun " in b]


def commands(block: str) -> list[list[str]]:
    """The torchrun command lines of `block` (continuations joined, comments and `&` dropped)."""
    text = block.replace("\\\n", " ")
    lines = [line.split("#")[0].strip().rstrip("&") for line in text.splitlines()]
    argvs = [shlex.split(line) for line in lines if "torchrun " in line]
    return [argv[argv.index("torchrun"):] for argv in argvs]  # without `VAR=value` before it


def run_recipe(script: str) -> list[str]:
    """Start the page's two torchrun commands of `script` at once, on 127.0.0.1 and a free
    port; each process's output (both must exit 0)."""
    block = next(b for b in torchrun_blocks() if script in b)
    port = str(free_port())
    argvs = []
    for argv in commands(block):
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
        argv[argv.index("--master-addr") + 1] = "127.0.0.1"
        argv[argv.index("--master-port") + 1] = port
        argvs.append(argv)
    assert [a[a.index("--node-rank") + 1] for a in argvs] == ["0", "1"], block
    # One intra-op thread per worker: the 4 workers share the machine's cores.
    env = dict(os.environ, OMP_NUM_THREADS="1", PIPETORCH_TIMEOUT="60")
    nodes = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for argv in argvs]
    try:
        logs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(logs)
    return logs


def last_line(log: str) -> list[str]:
    """The script's last line (it starts with the process id): torchrun's own log lines, such
    as c10d's "E1207 ..." at exit, may come after it."""
    return [line.split() for line in log.splitlines() if re.match(r"\d+ ", line)][-1]


def test_every_torchrun_recipe_is_run_by_a_test() -> None:
    scripts = {s for b in torchrun_blocks() for s in re.findall(r"\S+\.py\b", b)}
    assert scripts == set(RECIPES)
    for script, test in RECIPES.items():
        assert (ROOT / script).is_file(), script
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), test
        assert Path(script).stem in (ROOT / path).read_text(), test


def test_the_recipes_start_two_nodes_on_one_port() -> None:
    for block in torchrun_blocks():
        for argv in commands(block):
            assert argv[argv.index("--nnodes") + 1] == "2", block
        ports = {a[a.index("--master-port") + 1] for a in commands(block)}
        assert len(ports) == 1, block


@pytest.mark.slow
def test_train_py_keeps_the_processes_weights_equal() -> None:
    # each prints: process "of" processes [loss of each of its 2 replicas] sum(b.weight)
    lines = [last_line(log) for log in run_recipe("examples/torchrun/train.py")]
    assert [line[:3] for line in lines] == [["0", "of", "2"], ["1", "of", "2"]]
    losses = [[float(v) for v in re.findall(r"[-\d.e]+", " ".join(line[3:-1]))] for line in lines]
    assert [len(x) for x in losses] == [2, 2] and all(0 < v < 2 for x in losses for v in x)
    assert losses[0] != losses[1]  # each process trains on its own share of the data
    assert lines[0][-1] == lines[1][-1]  # yet the gradients were summed over all 4 replicas


def _pipeline_net() -> type[nn.Module]:
    """examples/torchrun/pipeline.py's Net (its imports and class only)."""
    tree = ast.parse((ROOT / "examples/torchrun/pipeline.py").read_text())
    tree.body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.ClassDef))]
    namespace: dict = {}
    exec(compile(tree, "pipeline.py", "exec"), namespace)  # noqa: S102 - the example's own code
    return namespace["Net"]


@pytest.mark.slow
def test_pipeline_py_trains_like_plain_pytorch() -> None:
    lines = [last_line(log) for log in run_recipe("examples/torchrun/pipeline.py")]
    assert [line[0] for line in lines] == ["0", "1"]
    assert lines[0][1:] == lines[1][1:]  # every process gets the loss and the trained weights

    # the same run by hand: 4 calls of 2 steps, each accumulating 4 micro-batches of 8
    torch.manual_seed(0)
    x, labels = torch.randn(256, 16), torch.randint(0, 4, (256,))
    net = _pipeline_net()()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for call in range(4):
        rows = slice(call * 64, (call + 1) * 64)
        got = plain_train_call(net, optimizer, x[rows], labels[rows], D=2, G=4, R=1)
    loss, weight = float(lines[0][1]), float(lines[0][2])
    assert_close(loss, float(got[-1][3]), rtol=1e-4, atol=1e-5)
    assert_close(weight, float(net.b.weight.detach().sum()), rtol=1e-4, atol=1e-5)
