"""benchmarks/search_check.py --quick: the search's top 3 layouts of a tiny GPT-2, each run
from the lines the search printed for it, with predicted against measured steps and order."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "search_check.py"


@pytest.mark.slow
@pytest.mark.transformers
@pytest.mark.timeout(600)  # the search times each piece, then three fresh interpreters train
def test_quick_run_measures_the_top_three_layouts_in_their_predicted_order():
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                          text=True, timeout=500)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert re.search(r"^tiny: \d+ layouts fit, \d+ do not; the top 3 measured", done.stdout,
                     re.M), done.stdout
    ranked = re.findall(r"^  ([123])\. (.+): predicted ([\d.]+) s, measured ([\d.]+) s",
                        done.stdout, re.M)
    assert [r[0] for r in ranked] == ["1", "2", "3"], done.stdout
    assert len({r[1] for r in ranked}) == 3  # three distinct layouts
    predicted = [float(r[2]) for r in ranked]
    assert predicted == sorted(predicted) and min(float(r[3]) for r in ranked) > 0
    assert re.search(r"^  measured order \(by predicted rank\): [123] < [123] < [123]; top pick "
                     r"/ fastest measured: \d\.\d{3} \(target <= 1\.15\)$", done.stdout, re.M)
