"""benchmarks/gpu.py (scripts/gpu-check.sh's benchmark) runs end to end on the CPU with --quick."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"


@pytest.mark.slow  # starts 2 pipetorch workers and an async loader process
def test_quick_cpu_run_writes_every_row(tmp_path) -> None:
    rows_file = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--device", "cpu",
                           "--json", str(rows_file)],
                          capture_output=True, text=True, timeout=170, cwd=SCRIPT.parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(rows_file.read_text())
    assert report["device"].startswith("CPU") and report["quick"] is True
    rows = {(r["group"], r["name"]): r for r in report["rows"]}
    assert {g for g, _ in rows} == {"overhead", "one GPU", "loader", "memory"}
    for (group, name), row in rows.items():
        assert f"{name}" in proc.stdout
        if group != "memory" or "estimate" in name and "measured" not in name:
            assert row["value"] > 0, row
        elif "measured" in name or "offload" in name:
            assert row["value"] is None, row  # no CUDA allocator on the CPU


def test_gpu_rows_share_one_gpu_between_the_stage_workers(monkeypatch) -> None:
    # gpu.py set PIPETORCH_DEVICE=cuda alone: on 2+ GPUs "2 workers sharing the device" ran
    # on two GPUs over NCCL
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up there
    monkeypatch.setattr(sys, "path", list(sys.path))  # it puts benchmarks/ and examples/ first
    spec.loader.exec_module(module)
    assert module.device_settings(torch.device("cuda")) == {
        "PIPETORCH_DEVICE": "cuda", "PIPETORCH_NUM_DEVICES": "1"}
    assert module.device_settings(torch.device("cpu")) == {"PIPETORCH_DEVICE": "cpu"}
