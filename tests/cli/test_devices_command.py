"""`pipetorch devices`: the device table, attached workers, stale records, --json and env."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipetorch as poptorch
from pipetorch.cli import devices
from pipetorch.cli.main import main
from pipetorch.parallel.layout.placement import cpu_cores
from helpers.models import MnistNetwork, WithLoss, mnist_data

TOP_KEYS = {"registry", "environment", "default", "cpu_threads", "devices"}
DEFAULT_KEYS = {"device", "devices", "cores", "threads_per_worker", "error"}
DEVICE_KEYS = {"device", "type", "index", "name", "cores", "cores_total", "memory_total",
               "memory_available", "visible", "workers"}
WORKER_KEYS = {"pid", "host_pid", "stages", "ipu", "device", "threads", "rss"}


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "registry"
    monkeypatch.setenv("PIPETORCH_REGISTRY", str(folder))
    monkeypatch.setenv("PIPETORCH_DEVICE", "cpu")
    monkeypatch.delenv("PIPETORCH_NUM_DEVICES", raising=False)
    monkeypatch.delenv("PIPETORCH_THREADS_PER_DEVICE", raising=False)
    return folder


def write_record(folder: Path, *, pid: int, stages: list[int], ipu: int, device: str = "cpu",
                 threads: int = 1, host_pid: int | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"worker-{pid}.json"
    record = {"stages": stages, "ipu": ipu, "device": device, "threads": threads, "pid": pid,
              "host_pid": os.getppid() if host_pid is None else host_pid}
    path.write_text(json.dumps(record))
    return path


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def run_devices(capsys: pytest.CaptureFixture, *args: str) -> str:
    assert main(["devices", *args]) == 0
    return capsys.readouterr().out


def run_json(capsys: pytest.CaptureFixture) -> dict:
    return json.loads(run_devices(capsys, "--json"))


def section(text: str, device: str) -> list[str]:
    """The device's row in the table and the indented lines under it."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [device])
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")),
               len(lines))
    return lines[start:end]


def test_live_worker_listed_under_cpu_and_stale_record_deleted(registry, capsys):
    live = write_record(registry, pid=os.getpid(), stages=[1, 4], ipu=3, threads=2)
    gone = dead_pid()
    stale = write_record(registry, pid=gone, stages=[0], ipu=0)
    text = run_devices(capsys)
    assert live.exists() and not stale.exists()
    cpu = section(text, "cpu")
    assert cpu[0].split()[-7:-5] == [str(cpu_cores()), "of"]  # CORES column: "N of M"
    assert f"  CPU threads asked for by all workers: 2 of {cpu_cores()} usable core(s)" in cpu
    assert "  1 attached process(es):" in cpu
    assert cpu[3].split() == ["PID", "HOST", "PID", "IPU", "STAGES", "THREADS", "RSS"]
    row = cpu[4].split()  # one worker per logical device, running every stage on it
    assert row[:5] == [str(os.getpid()), str(os.getppid()), "3", "1,4", "2"]
    assert row[6] == "MiB" and float(row[5]) > 1
    assert str(gone) not in text
    assert "Environment: PIPETORCH_DEVICE=cpu" in text.splitlines()
    assert f"Registry: {registry}" in text.splitlines()


def test_json_lists_the_same_with_documented_keys(registry, capsys):
    write_record(registry, pid=os.getpid(), stages=[1], ipu=3, threads=2)
    stale = write_record(registry, pid=dead_pid(), stages=[0], ipu=0)
    state = run_json(capsys)
    assert not stale.exists()
    assert set(state) == TOP_KEYS and set(state["default"]) == DEFAULT_KEYS
    assert state["registry"] == str(registry)
    assert state["environment"] == {"PIPETORCH_DEVICE": "cpu"}
    assert state["default"] == {"device": "cpu", "devices": ["cpu"], "cores": cpu_cores(),
                                "threads_per_worker": None, "error": None}
    assert state["cpu_threads"] == {"requested": 2, "cores": cpu_cores()}
    cpu = state["devices"][0]
    assert set(cpu) == DEVICE_KEYS
    assert (cpu["device"], cpu["type"], cpu["index"], cpu["visible"]) == ("cpu", "cpu", None, True)
    assert (cpu["cores"], cpu["cores_total"]) == (cpu_cores(), os.cpu_count())
    [worker] = cpu["workers"]
    assert set(worker) == WORKER_KEYS
    assert {k: worker[k] for k in WORKER_KEYS - {"rss"}} == {
        "pid": os.getpid(), "host_pid": os.getppid(), "stages": [1], "ipu": 3, "device": "cpu",
        "threads": 2}
    if Path("/proc/meminfo").exists():
        status = Path(f"/proc/{os.getpid()}/status").read_text()
        assert isinstance(worker["rss"], int) and worker["rss"] > 1 << 20
        assert "VmRSS:" in status
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        assert cpu["memory_total"] == int(meminfo["MemTotal"].split()[0]) * 1024
        assert 0 < cpu["memory_available"] <= cpu["memory_total"]


def test_worker_on_a_device_not_visible_here_gets_its_own_entry(registry, capsys):
    write_record(registry, pid=os.getpid(), stages=[0], ipu=0, device="cuda:99")
    state = run_json(capsys)
    entry = state["devices"][-1]
    assert set(entry) == DEVICE_KEYS
    assert (entry["device"], entry["type"], entry["index"], entry["visible"]) == ("cuda:99", "cuda", 99, False)
    assert [w["pid"] for w in entry["workers"]] == [os.getpid()]
    assert state["devices"][0]["workers"] == []
    text = run_devices(capsys)
    assert section(text, "cuda:99")[0].split()[1:4] == ["(not", "visible", "here)"]


def test_empty_registry_says_no_attached_processes(registry, capsys):
    text = run_devices(capsys)
    assert section(text, "cpu")[1:] == ["  No attached processes"]
    assert not registry.exists()  # listing creates nothing


def test_oversubscribed_threads_are_flagged(registry, capsys):
    write_record(registry, pid=os.getpid(), stages=[0], ipu=0, threads=cpu_cores() + 1)
    cpu = section(run_devices(capsys), "cpu")
    assert cpu[1] == (f"  CPU threads asked for by all workers: {cpu_cores() + 1} of "
                      f"{cpu_cores()} usable core(s) (oversubscribed: workers take turns)")


def test_environment_and_default_placement(registry, monkeypatch, capsys):
    monkeypatch.setenv("PIPETORCH_NUM_DEVICES", "1")
    monkeypatch.setenv("PIPETORCH_THREADS_PER_DEVICE", "3")
    state = run_json(capsys)
    assert state["environment"] == {"PIPETORCH_DEVICE": "cpu", "PIPETORCH_NUM_DEVICES": "1",
                                    "PIPETORCH_THREADS_PER_DEVICE": "3"}
    assert state["default"] == {"device": "cpu", "devices": ["cpu"], "cores": 1,
                                "threads_per_worker": 3, "error": None}
    lines = run_devices(capsys).splitlines()
    assert lines[1] == "Default: cpu (stage workers share 1 core(s), 3 thread(s) each)"
    assert lines[2] == ("Environment: PIPETORCH_DEVICE=cpu PIPETORCH_NUM_DEVICES=1 "
                        "PIPETORCH_THREADS_PER_DEVICE=3")


def test_bad_environment_is_reported_not_raised(registry, monkeypatch, capsys):
    monkeypatch.setenv("PIPETORCH_NUM_DEVICES", "0")
    state = run_json(capsys)
    assert state["default"]["error"] == "PIPETORCH_NUM_DEVICES='0' must be a positive whole number"
    assert state["default"]["device"] is None
    assert run_devices(capsys).splitlines()[1] == (
        "Default: unusable: PIPETORCH_NUM_DEVICES='0' must be a positive whole number")


def test_without_proc_files_falls_back_instead_of_crashing(registry, monkeypatch, tmp_path, capsys):
    missing = tmp_path / "no-proc"
    monkeypatch.setattr(devices, "_PROC", missing)
    write_record(registry, pid=os.getpid(), stages=[0], ipu=0)
    state = run_json(capsys)
    cpu = state["devices"][0]
    assert cpu["name"] == (platform.processor() or platform.machine() or None)
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        assert cpu["memory_total"] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert cpu["workers"][0]["rss"] is None
    row = section(run_devices(capsys), "cpu")[-1].split()
    assert row[0] == str(os.getpid()) and row[-1] == "-"


def test_help_documents_the_json_structure(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["devices", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for key in TOP_KEYS | DEFAULT_KEYS | DEVICE_KEYS | WORKER_KEYS:
        assert key in out


def test_python_m_pipetorch_devices_exits_0(registry):
    done = subprocess.run([sys.executable, "-m", "pipetorch", "devices"], capture_output=True,
                          text=True, timeout=60, env=os.environ.copy())
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.splitlines()[4].split() == ["DEVICE", "NAME", "CORES", "MEMORY", "AVAILABLE"]
    assert section(done.stdout, "cpu")[1:] == ["  No attached processes"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpus_listed_with_memory_and_their_workers(registry, capsys):
    write_record(registry, pid=os.getpid(), stages=[0], ipu=0, device="cuda:0")
    state = run_json(capsys)
    gpus = [d for d in state["devices"] if d["type"] == "cuda"]
    assert [g["device"] for g in gpus] == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for index, gpu in enumerate(gpus):
        assert set(gpu) == DEVICE_KEYS
        assert (gpu["index"], gpu["name"], gpu["visible"]) == (index, torch.cuda.get_device_name(index), True)
        assert gpu["memory_total"] == torch.cuda.mem_get_info(index)[1]
        assert 0 < gpu["memory_available"] <= gpu["memory_total"]
        assert gpu["cores"] is None
    assert [w["pid"] for w in gpus[0]["workers"]] == [os.getpid()]
    assert section(run_devices(capsys), "cuda:0")[-1].split()[:4] == [str(os.getpid()), str(os.getppid()), "0", "0"]


@pytest.mark.slow
def test_real_pipelined_workers_are_listed_until_destroy(registry, capsys):
    torch.manual_seed(0)
    model = WithLoss(MnistNetwork())
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(3)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(
        poptorch.Stage("B1", "B2").ipu(0), poptorch.Stage("B3", "B4").ipu(1)))
    wrapped = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        wrapped(*mnist_data(3))
        pids = wrapped._compiled.engine.worker_pids
        assert len(pids) == 2
        workers = [w for d in run_json(capsys)["devices"] for w in d["workers"]
                   if w["host_pid"] == os.getpid()]
        assert sorted((w["stages"], w["ipu"], w["pid"]) for w in workers) == [
            ([0], 0, pids[0]), ([1], 1, pids[1])]
        assert all(w["rss"] > 0 and w["threads"] >= 1 for w in workers)
    finally:
        wrapped.destroy()
    workers = [w for d in run_json(capsys)["devices"] for w in d["workers"]
               if w["host_pid"] == os.getpid()]
    assert workers == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_default_on_a_gpu_names_the_gpus_stage_workers_go_to(registry, capsys, monkeypatch):
    monkeypatch.setenv("PIPETORCH_DEVICE", "cuda")
    monkeypatch.setenv("PIPETORCH_NUM_DEVICES", "1")
    state = run_json(capsys)
    assert state["default"] == {"device": "cuda", "devices": ["cuda:0"], "cores": None,
                                "threads_per_worker": None, "error": None}
    lines = run_devices(capsys).splitlines()
    assert lines[1] == "Default: cuda (stage workers go to cuda:0)"
