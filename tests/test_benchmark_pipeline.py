"""benchmarks/pipeline.py: its hand-built stages match the model, and --quick runs end to end."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.scripts import load_benchmark

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "pipeline.py"


def test_blocks_compose_to_the_network_the_torch_pipelining_row_splits() -> None:
    bench = load_benchmark("pipeline")
    for size, features in ((28, 320), (128, 16820)):  # seed 000's view(-1, 320) at 28x28
        widths = bench.Widths(size)
        assert widths.features == features
        network = bench.new_network(widths)
        x = torch.randn(3, 1, size, size)
        blocks = network.blocks()
        for boundary in (1, 2, 3):
            staged = torch.nn.Sequential(*blocks[boundary:])(
                torch.nn.Sequential(*blocks[:boundary])(x))
            torch.testing.assert_close(staged, network(x), rtol=0, atol=0)


def test_closest_split_and_imbalance() -> None:
    bench = load_benchmark("pipeline")
    assert bench.closest_split([75.0, 105.0, 20.0, 0.2]) == 1  # 75 / 125.2 beats 180 / 20.2
    assert bench.closest_split([60.0, 50.0, 100.0, 10.0]) == 2  # 110 / 110
    assert bench.imbalance([120.0, 100.0, 15.0, 0.2], 1) == pytest.approx(120.0 / 115.2)


def _quick(models: str) -> str:
    root = str(SCRIPT.parent.parent)  # this checkout's pipetorch, not an installed one
    # one round: the rows' printing is what is tested here, not their medians
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--rounds", "1",
                           "--models", models],
                          capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _assert_rows(out: str, rows: list[str]) -> None:
    for row in rows:  # median, then the slowest..fastest call of the interleaved rounds
        assert re.search(rf"^{re.escape(row)}\s+[\d,.]+\s+[\d,.]+\.\.[\d,.]+", out, re.M), (row, out)


@pytest.mark.slow  # starts 2 pipetorch workers four times and 2 torch.distributed ranks
def test_quick_run_prints_every_row_ratio_and_trace() -> None:
    out = _quick("seed")
    cores = int(re.match(r"(\d+) cores;", out).group(1))
    assert re.search(r"split B[1-3](\+B\d)* \| B\d(\+B\d)*: [\d.]+ / [\d.]+ ms per stage", out)
    _assert_rows(out, ["plain PyTorch, 1 thread", f"plain PyTorch, {cores} threads",
                       "pipetorch, 1 device, 1 thread", "pipetorch, sharded over 2 devices",
                       "pipetorch, pipelined over 2 devices",
                       "pipetorch, pipelined over 2 devices, gloo transport",
                       "pipetorch, pipelined over 2 devices, profiling on",
                       "pipetorch, pipelined over 2 devices, zero-bubble",
                       "pipetorch, interleaved, 4 stages on 2 devices",
                       "torch.distributed.pipelining Schedule1F1B",
                       "torch.distributed.pipelining ScheduleInterleavedZeroBubble",
                       "torch.distributed.pipelining ScheduleInterleaved1F1B, 4 stages"])
    verdicts = re.findall(r"^\S.*\s\d+\.\d{3}  target >= \d\.\d\d  (?:NOT )?reached", out, re.M)
    assert len(verdicts) == 12, out  # 3 for the zero-bubble rows, 2 for the best schedules
    assert re.search(r"^best pipetorch schedule / best torch schedule\s+\d+\.\d{3}", out, re.M)
    assert re.search(r"^best torch schedule: torch\.distributed\.pipelining \w+", out, re.M)
    assert re.search(r"pipelined over 2 devices: last call \d+ ms on the host", out)
    # 2 stages x 4 traced rows (sharded, pipelined, gloo, zero-bubble), 4 of the interleaved
    assert len(re.findall(r"^  [0-3] +\d+ +\d+", out, re.M)) == 12


@pytest.mark.slow
@pytest.mark.transformers
def test_quick_bert_run_compares_with_plain_pytorch_and_torch_1f1b() -> None:
    pytest.importorskip("transformers")
    out = _quick("bert")
    cores = int(re.match(r"(\d+) cores;", out).group(1))
    assert "BertForSequenceClassification, 4 layers, hidden 256" in out
    _assert_rows(out, ["plain PyTorch, 1 thread", f"plain PyTorch, {cores} threads",
                       "pipetorch, pipelined over 2 devices",
                       "pipetorch, pipelined over 2 devices, gloo transport",
                       "torch.distributed.pipelining Schedule1F1B",
                       "pipetorch, interleaved, 4 stages on 2 devices"])
    assert re.search(r"^pipelined / torch.distributed.pipelining 1F1B\s+\d+\.\d{3}", out, re.M)
    assert re.search(r"^best pipetorch schedule / best torch schedule\s+\d+\.\d{3}", out, re.M)
