"""examples/popdist/popdist_training.py trains like plain PyTorch: 2 instances x 2 replicas
through `pipetorch run --num-instances`, through torchrun, and as one instance."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch
import pipetorch.popdist
import pipetorch.popdist.poptorch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "popdist" / "popdist_training.py"
# The script's defaults: 2 epochs of 64 samples, micro-batch 2, 2 device iterations, 4 replicas.
EPOCHS, SIZE, B, D, REPLICAS, SEED, LR, MOMENTUM = 2, 64, 2, 2, 4, 0, 0.1, 0.9
STEP = B * REPLICAS  # samples of one optimiser step, over all replicas


def load_script() -> ModuleType:
    """The example as a module (its main block not run), `poptorch`/`popdist` as pipetorch's."""
    aliases = {"poptorch": pipetorch, "popdist": pipetorch.popdist,
               "popdist.poptorch": pipetorch.popdist.poptorch}
    added = [name for name in aliases if name not in sys.modules]
    sys.modules.update({name: aliases[name] for name in added})
    try:
        spec = importlib.util.spec_from_file_location("popdist_training_example", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name in added:
            del sys.modules[name]
    return module


def run(cmd: list[str], cwd: Path) -> None:
    env = dict(os.environ, PIPETORCH_TIMEOUT="60")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def plain_training(example: ModuleType, steps: list[tuple[torch.Tensor, torch.Tensor]]):
    """The example's model trained by torch alone, one SGD step on each (x, y): the mean
    loss over a step's samples is the mean over its replicas' micro-batches."""
    torch.manual_seed(SEED)
    net = example.ModelWithLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    for x, y in steps:
        optimizer.zero_grad()
        F.nll_loss(F.log_softmax(net.model(x), dim=1), y).backward()
        optimizer.step()
    return net.state_dict()


def instance_steps(example: ModuleType, instances: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's samples when `instances` instances share the replicas: every epoch one
    permutation from the seed; instance p reads its p-th contiguous block, one host call of
    D steps x (replicas of p) x B at a time; a step takes each instance's next rows."""
    x, y = example.dataset(SIZE, SEED).tensors
    generator = torch.Generator().manual_seed(SEED)
    per_instance, local = SIZE // instances, B * REPLICAS // instances
    steps = []
    for _ in range(EPOCHS):
        order = torch.randperm(SIZE, generator=generator)
        blocks = order.view(instances, per_instance)
        for s in range(per_instance // local):
            rows = blocks[:, s * local:(s + 1) * local].reshape(-1)
            steps.append((x[rows], y[rows]))
    return steps


def one_instance_steps(example: ModuleType) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's samples in one process: the order of the script's own shuffling DataLoader,
    drawn from the global RNG as the script draws it (seeded, after building the model)."""
    torch.manual_seed(SEED)
    opts = pipetorch.Options().replicationFactor(REPLICAS).deviceIterations(D)
    loader = pipetorch.DataLoader(opts, example.dataset(SIZE, SEED), batch_size=B,
                                  shuffle=True)
    example.ModelWithLoss()
    return [(x[i:i + STEP], y[i:i + STEP]) for _ in range(EPOCHS) for x, y in loader
            for i in range(0, len(x), STEP)]


def checkpoints(folder: Path, instances: int) -> list[dict[str, torch.Tensor]]:
    found = sorted(p.name for p in folder.glob("checkpoint-instance-*.pt"))
    assert found == [f"checkpoint-instance-{i}.pt" for i in range(instances)]
    return [torch.load(folder / name) for name in found]


def assert_trained_like(got: list[dict[str, torch.Tensor]], want: dict[str, torch.Tensor]):
    for instance, state in enumerate(got):
        assert state.keys() == want.keys()
        for name, value in want.items():
            assert_close(state[name], value, msg=f"instance {instance}: {name}")


def test_pipetorch_run_two_instances_of_two_replicas(tmp_path: Path) -> None:
    run([sys.executable, "-m", "pipetorch", "run", "--num-instances", "2", "--num-replicas",
         "4", str(SCRIPT)], tmp_path)
    example = load_script()
    assert_trained_like(checkpoints(tmp_path, 2), plain_training(example, instance_steps(example, 2)))


def test_torchrun_runs_the_same_script_with_two_processes(tmp_path: Path) -> None:
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "pipetorch", "run", "--num-replicas", "4", str(SCRIPT)], tmp_path)
    example = load_script()
    assert_trained_like(checkpoints(tmp_path, 2), plain_training(example, instance_steps(example, 2)))


def test_without_a_launcher_the_script_trains_as_one_instance(tmp_path: Path) -> None:
    run([sys.executable, "-m", "pipetorch", "run", str(SCRIPT)], tmp_path)
    example = load_script()
    assert_trained_like(checkpoints(tmp_path, 1), plain_training(example, one_instance_steps(example)))
