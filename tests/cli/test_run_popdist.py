"""`pipetorch run`'s PopRun side: `import popdist`, --num-instances / --num-replicas, and
PopRun's flags that have no equivalent here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipetorch.cli.main import main
from pipetorch.popdist import launch

POPDIST_SCRIPT = """\
import json, subprocess, sys
import popdist
import popdist.poptorch
import poptorch
import pipetorch.popdist

opts = popdist.poptorch.Options()
child = subprocess.run([sys.executable, "-c", "import popdist, pipetorch.popdist; "
                        "print(popdist is pipetorch.popdist)"], capture_output=True, text=True)
with open(sys.argv[1], "w") as f:
    json.dump({
        "argv": sys.argv[2:],
        "same_package": popdist is pipetorch.popdist,
        "options_class": issubclass(popdist.poptorch.Options, poptorch.Options),
        "env_set": popdist.isPopdistEnvSet(),
        "replicas": [popdist.getNumTotalReplicas(), popdist.getNumLocalReplicas(),
                     opts.replication_factor],
        "ipus": [popdist.getNumIpusPerReplica(), opts.ipus_per_replica],
        "child_same_package": child.stdout.strip(),
    }, f)
"""
VARS = ("POPDIST_NUM_TOTAL_REPLICAS", "POPDIST_NUM_IPUS_PER_REPLICA", "WORLD_SIZE", "RANK",
        "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PYTHONPATH")


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in VARS}


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """`main()` in this process, with what `run` changes in the interpreter undone."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for var in VARS:
        monkeypatch.setenv(var, "")  # recorded, so that what `run` sets is undone after
        monkeypatch.delenv(var)
    yield main
    for name, module in list(sys.modules.items()):
        aliased = name.split(".")[0] in ("poptorch", "popdist")
        if aliased or str(getattr(module, "__file__", "")).startswith(str(tmp_path)):
            del sys.modules[name]


def test_popdist_resolves_to_pipetorch_under_run_with_the_replicas_given(tmp_path: Path) -> None:
    script = write(tmp_path, "train.py", POPDIST_SCRIPT)
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pipetorch", "run", "--num-replicas", "4", "--ipus-per-replica",
         "2", str(script), str(out), "--num-replicas", "9"],
        cwd=tmp_path, env=plain_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == {
        "argv": ["--num-replicas", "9"],  # after SCRIPT: the script's own arguments
        "same_package": True, "options_class": True, "env_set": True,
        "replicas": [4, 4, 4], "ipus": [2, 2], "child_same_package": "True"}


def test_plain_run_is_not_a_launch(tmp_path: Path, in_process) -> None:
    script = write(tmp_path, "train.py", POPDIST_SCRIPT)
    out = tmp_path / "out.json"
    assert in_process(["run", str(script), str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["env_set"], result["replicas"], result["ipus"]) == (False, [1, 1, 1], [1, 1])


def test_nothing_named_popdist_is_installed_outside_run() -> None:
    code = ("import importlib.util, pipetorch; spec = importlib.util.find_spec('popdist'); "
            "print(spec is None or 'pipetorch' not in str(spec.origin))")
    proc = subprocess.run([sys.executable, "-c", code], env=plain_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout.strip() == "True", proc.stderr


def test_num_instances_starts_them_through_torchrun(tmp_path: Path, in_process,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    script = write(tmp_path, "train.py", "x = 1\n")
    started = []

    def call(argv: list[str]) -> int:
        started.append(argv)
        return 5
    monkeypatch.setattr(launch.subprocess, "call", call)
    assert in_process(["run", "--num-instances", "2", "--num-replicas", "4", str(script),
                       "--lr", "1"]) == 5
    assert started == [[sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", "-m", "pipetorch", "run", "--num-replicas",
                        "4", str(script), "--lr", "1"]]


def test_num_instances_inside_torchrun_must_match_its_processes(
        tmp_path: Path, in_process, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    script = write(tmp_path, "train.py", "import popdist, sys\n"
                   "sys.exit(10 * popdist.getNumLocalReplicas() + popdist.getInstanceIndex())\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_info:
        in_process(["run", "--num-instances", "2", "--num-replicas", "6", str(script)])
    assert exit_info.value.code == 31  # run here, not relaunched: 3 local replicas, index 1
    with pytest.raises(SystemExit) as exit_info:
        in_process(["run", "--num-instances", "3", str(script)])
    assert exit_info.value.code == 2
    assert "--num-instances 3 was given inside a launch of 2 processes" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--num-instances", "2", "--num-replicas", "3"],
     "--num-replicas (3) must be a multiple of --num-instances (2)"),
    (["--num-replicas", "0"], "argument --num-replicas: expected an integer >= 1, got '0'"),
    (["--host", "h1,h2"], "PopRun's --host has no `pipetorch run` equivalent: start torchrun "
                          "on each host: `torchrun --nnodes H"),
    (["--vipu-partition", "p"], "there are no V-IPU partitions"),
    (["--mpi-global-args", "--tag-output --allow-run-as-root"],
     "instances are torchrun processes, not MPI ranks"),
])
def test_bad_launches_are_usage_errors(tmp_path: Path, in_process, argv: list[str],
                                       message: str, capsys: pytest.CaptureFixture) -> None:
    script = write(tmp_path, "train.py", "x = 1\n")
    with pytest.raises(SystemExit) as exit_info:
        in_process(["run", *argv, str(script)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_replicas_that_do_not_share_out_name_the_fix(tmp_path: Path, in_process,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    script = write(tmp_path, "train.py", "x = 1\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        in_process(["run", "--num-replicas", "3", str(script)])
    assert ("POPDIST_NUM_TOTAL_REPLICAS=3 replicas cannot be shared out evenly over 2 "
            "instances") in capsys.readouterr().err
