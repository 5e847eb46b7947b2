"""A mapped model's trained weights saved as HuggingFace's sharded checkpoint: a file per
stage and model.safetensors.index.json, read back by map_weights and by transformers
(weights/saving.py, weights/checkpoint.py). Across processes: tests/parallel/test_cross_process.py."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file, save_model
from torch.testing import assert_close

from helpers.reference import train_language_model_call

import pipetorch as poptorch
from pipetorch.errors import ConfigError
from pipetorch.weights import checkpoint, saving

G = 4


def gpt2_config(transformers):
    return transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=4,
                                   n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   use_cache=False)


def mapped_gpt2(transformers, path, **output):
    with poptorch.empty_weights():
        model = transformers.GPT2LMHeadModel(gpt2_config(transformers))
    poptorch.map_weights(model, path, **output)
    model.transformer.h[2] = poptorch.BeginBlock(model.transformer.h[2], ipu_id=1)
    return model



@pytest.mark.slow
@pytest.mark.transformers
def test_a_folder_output_is_a_file_per_stage_that_transformers_and_map_weights_read(tmp_path):
    transformers = pytest.importorskip("transformers")
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(G)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(gpt2_config(transformers))
    save_model(plain, str(tmp_path / "gpt2.safetensors"))  # wte once: lm_head is tied to it
    model = mapped_gpt2(transformers, tmp_path / "gpt2.safetensors", output=tmp_path / "out")
    wrapper = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for call in range(2):
        train_language_model_call(wrapper, plain, plain_optimizer, call, G)
    wrapper.copyWeightsToHost()
    folder = tmp_path / "out"
    index = json.loads((folder / checkpoint.INDEX).read_text())
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert index["metadata"][checkpoint.POINT] == "2"
    saved = {f: load_file(str(folder / f)) for f in (first, second)}
    # the tied weight once (under the source's one name), in the file of the first stage
    # holding it (wte's, not lm_head's); h.2 onwards in the second
    assert index["weight_map"]["lm_head.weight"] == first
    assert "transformer.wte.weight" not in index["weight_map"]
    assert {n for n, f in index["weight_map"].items() if f == second} == set(saved[second])
    assert all(n.startswith(("transformer.h.2.", "transformer.h.3.", "transformer.ln_f."))
               for n in saved[second])
    want = plain.state_dict()
    for tensors in saved.values():
        for name, value in tensors.items():
            assert_close(value, want[name], msg=name)
    plain.config.save_pretrained(folder)
    # from_pretrained patches torch.linspace for a while: were torch's cached set of factory
    # functions first built then, `with torch.device("meta")` would miss linspace for the
    # rest of the process (a later test's meta buffers came out on the CPU). Build it first.
    with torch.device("meta"):
        torch.empty(0)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(folder)
    for name, value in want.items():
        assert_close(loaded.state_dict()[name], value, msg=name)
    written = [(folder / f).stat().st_ino for f in (first, second)]
    wrapper.destroy()  # brings the optimiser's state home: the weights' files stay as written
    assert [(folder / f).stat().st_ino for f in (first, second)] == written
    # mapped again from the folder, training goes on where it stopped
    again = mapped_gpt2(transformers, folder)
    resumed = poptorch.trainingModel(again, opts, torch.optim.SGD(again.parameters(), lr=0.1))
    train_language_model_call(resumed, plain, plain_optimizer, 2, G)
    resumed.destroy()


def index(folder, weight_map):
    (folder / checkpoint.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_checkpoint_of_files_from_different_points_is_refused(tmp_path):
    for n, point in enumerate(["2", "3"]):
        save_file({f"w{n}": torch.zeros(2)}, str(tmp_path / f"f{n}.safetensors"),
                  metadata={"format": "pt", checkpoint.POINT: point})
    index(tmp_path, {"w0": "f0.safetensors", "w1": "f1.safetensors"})
    with pytest.raises(ConfigError, match="different points of training.*f0.safetensors: 2"):
        checkpoint.Checkpoint(tmp_path)
    index(tmp_path, {"w0": "f1.safetensors"})
    with pytest.raises(ConfigError, match="'w0', which that file does not hold"):
        checkpoint.Checkpoint(tmp_path / checkpoint.INDEX)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds neither"):
        checkpoint.Checkpoint(tmp_path / "empty")


def test_a_tensor_whose_file_is_on_another_machine_keeps_what_the_model_holds(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    save_file({"0.weight": torch.ones(2, 2), "0.bias": torch.ones(2)},
              str(tmp_path / checkpoint.shard_name(0, 2)))
    index(tmp_path, {"0.weight": checkpoint.shard_name(0, 2), "0.bias": checkpoint.shard_name(
        0, 2), "1.weight": checkpoint.shard_name(1, 2), "1.bias": checkpoint.shard_name(1, 2)})
    kept = model[1].weight.detach().clone()
    poptorch.map_weights(model, tmp_path)
    assert_close(model[0].weight, torch.ones(2, 2))
    assert_close(model[1].weight, kept)
    with torch.device("meta"):  # nothing to keep: refused, naming the file
        empty = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="not on this machine.*model-00002-of-00002"):
        poptorch.map_weights(empty, tmp_path)


def test_one_output_file_is_refused_when_this_process_holds_some_stages(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    source = checkpoint.Checkpoint(tmp_path / "w.safetensors")
    writer = saving.Writer(str(tmp_path / "out.safetensors"), source, model)
    with pytest.raises(ConfigError, match=r"holds stage\(s\) \[1\] of 2.*output='.*out'"):
        writer.place(list(model), held={1})
    folder = saving.Writer(str(tmp_path / "out"), source, model)
    folder.place(list(model), held={1})
    assert folder.mine == {checkpoint.shard_name(1, 2)}
