"""A wrapper nobody keeps: its weights reach the model when it goes, and exit stays clean."""
import subprocess
import sys
import textwrap

import torch

import pipetorch as poptorch
from helpers.models import TinyMLP, data


def test_dropped_wrapper_flushes_its_weights_into_the_model():
    model = TinyMLP()
    before = model.fc1.weight.detach().clone()
    x, y = data(8)
    wrapper = poptorch.trainingModel(model, poptorch.Options(),
                                     poptorch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    wrapper(x, y)
    del wrapper  # no cycle keeps it: deleted now, and it copies the trained weights home
    assert not torch.equal(model.fc1.weight.detach(), before)


def test_interpreter_exit_with_an_undestroyed_wrapper_is_clean(tmp_path):
    # The model used to keep its wrapper alive through the pending weight copy, so the wrapper
    # was only collected at interpreter exit, where the copy aborted Python (exit code 134).
    script = tmp_path / "leave.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.nn as nn, pipetorch as poptorch
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 10)
            def forward(self, x, y):
                out = self.fc(x)
                return out, nn.functional.cross_entropy(out, y)
        def run():
            m = M()
            opt = poptorch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
            poptorch.trainingModel(m, poptorch.Options(), opt)(torch.randn(8, 4),
                                                               torch.randint(0, 10, (8,)))
        run()
        print("done")
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("done")
