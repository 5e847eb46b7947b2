"""generate() on a model whose class, forward hook and custom layer are defined in the user's own
script (its `__main__`), run as `python script.py` and as `python -c`: the same tokens as plain
HuggingFace."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.transformers]

ROOT = Path(__file__).resolve().parent.parent.parent

# Issue 39: every class, hook or layer defined in the user's script failed generate() with
# "died during preparing generate() (exit code 1)": it was pickled by reference to __main__,
# and a worker's __main__ is another module.
SCRIPT = '''
import json
import torch, torch.nn as nn, transformers
import pipetorch as poptorch

class MyGPT(transformers.GPT2LMHeadModel):
    pass

class Boost(nn.Module):
    """A custom layer: the activation, scaled."""
    def __init__(self, act):
        super().__init__()
        self.act = act
    def forward(self, x):
        return 1.5 * self.act(x)

def halve(module, args, output):
    return output * 0.5

def tokens(model):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (4, 6), generator=g)
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                          do_sample=False, pad_token_id=0).tolist()

torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=4, n_head=2,
                                 initializer_range=0.3)
model = MyGPT(config).eval()
bare = tokens(model)
model.transformer.h[1].mlp.act = Boost(model.transformer.h[1].mlp.act)
model.transformer.h[3].mlp.register_forward_hook(halve)
plain = tokens(model)
model.transformer.h[2] = poptorch.BeginBlock(model.transformer.h[2], ipu_id=1)
opts = poptorch.Options().deviceIterations(2).showCompilationProgressBar(False)
opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu))
wrapper = poptorch.inferenceModel(model, opts)
staged = tokens(wrapper)
workers = len(wrapper._compiled.engine.worker_pids)
wrapper.destroy()
print("RESULT " + json.dumps(dict(bare=bare, plain=plain, staged=staged, workers=workers)))
'''


def run(command: list[str], **env: str) -> dict:
    found = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env=os.environ | {"PYTHONPATH": str(ROOT),
                                             "PIPETORCH_THREADS_PER_DEVICE": "1"} | env)
    lines = [line for line in found.stdout.splitlines() if line.startswith("RESULT ")]
    assert found.returncode == 0 and lines, found.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("how", ["script", "dash-c, fresh workers"])
def test_a_script_defined_subclass_hook_and_layer_generate_like_plain_hf(tmp_path, how):
    if how == "script":
        path = tmp_path / "user_script.py"
        path.write_text(SCRIPT)
        result = run([sys.executable, str(path)])
    else:  # no file behind __main__, as in a notebook; workers started fresh, not forked
        result = run([sys.executable, "-c", SCRIPT], PIPETORCH_WORKER_POOL="0")
    assert result["workers"] == 2
    assert result["plain"] != result["bare"]  # the hook and the layer change the tokens
    assert result["staged"] == result["plain"]
