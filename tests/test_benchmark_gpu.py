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
