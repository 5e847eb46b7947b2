"""benchmarks/resnet_story.py: the budget lies between the peaks, and --quick tells the story."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.scripts import load_benchmark

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "resnet_story.py"
ROWS = ("16.16 GA 3", "+ GA 8", "+ DI 4", "+ 8-bit I/O", "+ async loader",
        "async loader row + optimiser offload", "plain PyTorch 16.16, GA 8 DI 4, 1 thread", "32.32, last row's batching (no budget)",
        "plain PyTorch 32.32, GA 8 DI 4, 1 thread")


@pytest.mark.parametrize("fits, over, budget", [
    (184_900, 297_200, 230_000),        # geometric mean 234,419 rounded down to 2 digits
    (6_097_404, 9_791_164, 7_700_000),
    (100, 101, 100),                     # a peak equal to the budget fits
    (99, 101, 99),
    (989, 991, 990),                     # 980 (rounded) is below 989: the midpoint instead
])
def test_the_budget_lets_16_16_fit_and_refuses_32_32(fits: int, over: int, budget: int) -> None:
    bench = load_benchmark("resnet_story")
    chosen = bench.choose_budget(fits, over)
    assert fits <= chosen < over
    assert chosen == budget


def test_a_16_16_peak_not_below_32_32_is_refused_with_the_values() -> None:
    bench = load_benchmark("resnet_story")
    with pytest.raises(ValueError, match=r"needs 0 < fits < over, got fits=5, over=5: the "
                                         r"16\.16 estimate must be below the 32\.32 one"):
        bench.choose_budget(5, 5)


@pytest.mark.slow  # compiles 6 two-device models (12 stage workers) and 3 estimates
def test_quick_run_prints_the_refusal_the_fit_and_every_row() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                          text=True, timeout=400, cwd=SCRIPT.parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.match(r"\d+ cores \(of \d+\), torch \S+, \d+ intra-op threads", out)
    budget = re.search(r"budget chosen between them: opts\.setMemoryBudget\((\d+)\)", out)
    assert budget, out
    assert "32.32 GA 3: refused at compile, OutOfMemoryError:" in out
    assert re.search(r"\| Out of memory: the estimated peak of IPU 1 is [\d.]+ [KM]iB, over its "
                     r"budget of [\d.]+ [KM]iB", out), out
    assert re.search(r"\| IPU 0 .*\n  \| IPU 1 .*OVER by", out), out
    # a half model keeps float32 optimiser moments (PopTorch's default), so fp16 saves less
    # than offloading that state and need not be ranked first
    assert re.search(r"\| \d\. fp16 weights, activations and inputs: saves [\d.]+ [KM]iB; fits "
                     r"on its own", out), out
    assert re.search(r"16\.16 GA 3: compiled under the same budget \(estimated peak [\d.]+ "
                     r"[KM]iB <= [\d.]+ [KM]iB\) and ran", out), out
    h2d = {}
    for row in ROWS:
        match = re.search(rf"^{re.escape(row)}\s+(\d+)\s+([\d.]+)\s.*?(\S+)$", out, re.M)
        assert match, (row, out)
        assert float(match[2]) > 0
        h2d[row] = match[3]
    # micro-batch 2 of 3x32x32 images: fp16 6144 bytes + an int64 label, uint8 3072 + 8.
    assert [h2d[row] for row in ROWS[:6]] == ["6,152", "6,152", "6,152", "3,080", "3,080",
                                              "3,080"]
    assert h2d[ROWS[7]] == "3,080" and h2d[ROWS[6]] == h2d[ROWS[8]] == "-"
    assert re.search(r"^Optimiser offload: [\d.]+ images/s, [\d.]+x the same row", out, re.M)
    assert re.search(r"^\+ GA 8\s+16\s+[\d.]+\s+[\d.]+x\s+[\d.]+x", out, re.M), out
    assert "from the H2D spans of the last timed call" in out
    assert re.search(r"here 32\.32 with the last row's batching ran at [\d.]+ images/s", out)
