"""Remake the guide's report screenshots (docs/images/) with pipetorch's own report writer.

Trains a small MLP over 2 devices, sharded then pipelined, with profiling on; writes their
report.html and `pipetorch report compare`'s compare.html; photographs each page with a
headless Chromium. Run: .venv/bin/python scripts/docs_screenshots.py [--browser chromium]
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import pipetorch as poptorch
from pipetorch.cli.report import compare_reports

IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"


class Mlp(torch.nn.Module):
    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        with poptorch.Block("B1"):
            for layer in self.layers[:2]:
                x = torch.relu(layer(x))
        with poptorch.Block("B2"):
            for layer in self.layers[2:]:
                x = torch.relu(layer(x))
            out = self.head(x)
            return out, torch.nn.functional.cross_entropy(out, labels)


def profile(folder: Path, strategy: type) -> Path:
    opts = poptorch.Options().deviceIterations(2).enableProfiling(str(folder))
    opts.Training.gradientAccumulation(6)
    opts.setExecutionStrategy(strategy(poptorch.Stage("B1").ipu(0), poptorch.Stage("B2").ipu(1)))
    torch.manual_seed(0)
    net = Mlp()
    model = poptorch.trainingModel(net, opts, optimizer=poptorch.optim.SGD(net.parameters(), lr=0.01))
    n = 2 * 6 * 32
    for _ in range(4):
        model(torch.randn(n, 512), torch.randint(0, 10, (n,)))
    model.destroy()  # writes the report
    return folder / "training"


def photograph(browser: str, page: Path, image: Path, height: int) -> None:
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size=1100,{height}", f"--screenshot={image}", page.as_uri()],
                   check=True, capture_output=True, timeout=120)
    print(f"wrote {image}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--browser", default=shutil.which("chromium") or shutil.which("google-chrome"))
    args = parser.parse_args()
    if not args.browser:
        print("no headless browser found (chromium, google-chrome); pass --browser", file=sys.stderr)
        return 1
    IMAGES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sharded = profile(Path(tmp) / "sharded", poptorch.ShardedExecution)
        pipelined = profile(Path(tmp) / "pipelined", poptorch.PipelinedExecution)
        compare_reports(str(sharded), str(pipelined), output=tmp)
        photograph(args.browser, pipelined / "report.html", IMAGES / "report.png", 1000)
        photograph(args.browser, Path(tmp) / "compare.html", IMAGES / "compare.png", 800)
    return 0


if __name__ == "__main__":
    sys.exit(main())
