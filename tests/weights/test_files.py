"""Models built without weights, their weights mapped from a safetensors file that each stage
worker reads its part of (weights/files.py, weights/mapped.py)."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file, save_model

import pipetorch as poptorch
from pipetorch.errors import ConfigError
from pipetorch.parallel.comm import resident

from helpers.reference import train_language_model_call

pytestmark = pytest.mark.slow

G = 4


class Stack(torch.nn.Module):
    """Four wide layers in two blocks, with a loss."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))
        self.register_buffer("shift", torch.linspace(-1, 1, width), persistent=False)

    def forward(self, x, target):
        x = x + self.shift
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, torch.nn.functional.mse_loss(x, target)


def split(model: Stack) -> Stack:
    model.layers[2] = poptorch.BeginBlock(model.layers[2], ipu_id=1)
    return model


def options():
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(G)
    return opts


def data(width, seed, rows=G * 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


def plain_call(model, optimizer, x, target):
    losses = []
    for m in range(G):
        rows = slice(m * len(x) // G, (m + 1) * len(x) // G)
        _, loss = model(x[rows], target[rows])
        (loss / G).backward()
        losses.append(loss.detach())
    optimizer.step()
    optimizer.zero_grad()
    return losses[-1]


def test_a_model_built_without_weights_trains_as_plain_pytorch_and_saves_to_its_file(tmp_path):
    torch.manual_seed(0)
    plain = Stack()
    save_file(plain.state_dict(), str(tmp_path / "w.safetensors"))
    with poptorch.empty_weights():
        model = Stack()
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.shift.device.type == "cpu"  # buffers a model computes are real
    out = tmp_path / "trained.safetensors"
    poptorch.map_weights(split(model), tmp_path / "w.safetensors", output=out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)  # built after mapping
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.01)
    wrapper = poptorch.trainingModel(model, options(), optimizer)
    for call in range(3):
        x, target = data(64, call)
        _, loss = wrapper(x, target)
        torch.testing.assert_close(loss, plain_call(plain, plain_optimizer, x, target))
    wrapper.copyWeightsToHost()
    saved = load_file(str(out))
    assert set(saved) == set(plain.state_dict())
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(saved[name], value, msg=name)
        torch.testing.assert_close(model.state_dict()[name], value, msg=name)
    # the host's copy is the written file, mapped
    from pipetorch.weights import mapped
    assert mapped.region_of(model.layers[0].weight.untyped_storage()).path == str(out)
    x, target = data(64, 3)
    _, loss = wrapper(x, target)  # training goes on from the workers' weights
    torch.testing.assert_close(loss, plain_call(plain, plain_optimizer, x, target))
    wrapper.destroy()


@pytest.mark.transformers
def test_a_tied_hf_model_from_its_config_maps_and_trains(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=4,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     use_cache=False)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config)
    save_model(plain, str(tmp_path / "gpt2.safetensors"))  # one name for the tied weight
    with poptorch.empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    poptorch.map_weights(model, tmp_path / "gpt2.safetensors")
    model.transformer.h[2] = poptorch.BeginBlock(model.transformer.h[2], ipu_id=1)
    wrapper = poptorch.trainingModel(model, options(), torch.optim.SGD(model.parameters(), lr=0.1))
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for call in range(3):
        train_language_model_call(wrapper, plain, plain_optimizer, call, G)
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, msg=name)
    wrapper.destroy()


def test_the_host_never_reads_mapped_weights_until_they_are_copied_back(tmp_path):
    """Host memory grows by a fraction of the model while it trains in the workers, and by
    about the model once its weights are copied into memory (no output file): both measured
    in this run, as ratios of the model's bytes."""
    width = 1024  # 4 layers of 1024 x 1024: 16.8 MB of weights
    torch.manual_seed(0)
    save_file(Stack(width).state_dict(), str(tmp_path / "w.safetensors"))
    with poptorch.empty_weights():
        model = Stack(width)
    poptorch.map_weights(split(model), tmp_path / "w.safetensors")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    before = resident.rss(os.getpid())
    wrapper = poptorch.trainingModel(model, options(), torch.optim.SGD(model.parameters(), lr=0.1))
    for call in range(2):
        wrapper(*data(width, call))
    after_training = resident.rss(os.getpid())
    trained = after_training - before
    wrapper.copyWeightsToHost()
    copied = resident.rss(os.getpid()) - after_training  # the copy's own growth
    wrapper.destroy()
    assert trained < 0.3 * size < 0.7 * size < copied, (trained, copied, size)


def test_mapping_refuses_what_it_cannot_use(tmp_path):
    save_file({"layers.0.weight": torch.zeros(64, 64)}, str(tmp_path / "small.safetensors"))
    with torch.device("meta"):
        model = Stack()
    with pytest.raises(ConfigError, match="empty_weights"):
        poptorch.map_weights(model, tmp_path / "small.safetensors")
    torch.manual_seed(0)
    save_file(Stack(8).state_dict(), str(tmp_path / "narrow.safetensors"))
    with pytest.raises(ValueError, match=r"shape \[8, 8\] in the file but \[64, 64\]"):
        poptorch.map_weights(Stack(), tmp_path / "narrow.safetensors")
    with pytest.raises(ConfigError, match="must be a .safetensors file"):
        poptorch.map_weights(Stack(), tmp_path / "w.pt")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        poptorch.map_weights(Stack(), tmp_path / "absent.safetensors")


# Issue 39: a 6-layer GPT-2 checkpoint mapped into a 4-layer model trained without a word, where
# a strict load_state_dict refuses it; a missing parameter was spoken of as a buffer.
def test_mapping_is_strict_as_load_state_dict_and_names_what_differs(tmp_path):
    transformers = pytest.importorskip("transformers")

    def gpt2(layers):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=50, n_positions=16, n_embd=16, n_layer=layers, n_head=2))

    torch.manual_seed(0)
    six = gpt2(6)
    path = tmp_path / "six.safetensors"
    save_model(six, str(path))
    with poptorch.empty_weights():
        four = gpt2(4)
    with pytest.raises(ConfigError) as info:
        poptorch.map_weights(four, path)
    message = str(info.value)
    assert "does not match the model (strict=True, as load_state_dict)" in message, message
    assert "tensor(s) the model does not have: 'transformer.h.4.attn.c_attn.bias'" in message, message
    assert "strict=False" in message
    assert all(p.device.type == "meta" for p in four.parameters())  # nothing mapped
    poptorch.map_weights(four, path, strict=False)
    for name, value in four.state_dict().items():
        assert torch.equal(value, six.state_dict()[name]), name

    # a parameter the file lacks: named as a parameter, with the fix
    save_file({k: v for k, v in Stack().state_dict().items() if k != "layers.3.bias"},
              str(tmp_path / "short.safetensors"))
    with poptorch.empty_weights():
        model = Stack()
    with pytest.raises(ConfigError, match=r"holds no parameter\(s\) 'layers.3.bias', which the "
                                          r"model has on the meta device \(no values\): save "):
        poptorch.map_weights(model, tmp_path / "short.safetensors")
    built = Stack()  # with its own weights: strict refuses, strict=False keeps its own bias
    with pytest.raises(ConfigError, match=r"does not match.*holds no parameter\(s\) "
                                          r"'layers.3.bias'\. Map the file"):
        poptorch.map_weights(built, tmp_path / "short.safetensors")
    bias = built.layers[3].bias.detach().clone()
    poptorch.map_weights(built, tmp_path / "short.safetensors", strict=False)
    assert torch.equal(built.layers[3].bias, bias)
