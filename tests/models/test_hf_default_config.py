"""HuggingFace models with the config they come with (use_cache=True) split over two devices."""
from __future__ import annotations

import logging
from typing import Any, Callable

import pytest
import torch
from torch.utils import _pytree as pytree

import pipetorch as poptorch
from hf_cases import SEQ, VOCAB, Inputs, plain_call, twin
from parallel.parallel_cases import assert_same_state, cleaned, one_thread_everywhere
from test_hf_pipelined import assert_same_output, options, sgd

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.transformers]

D, B, G, CALLS = 2, 2, 3, 2


@pytest.fixture(autouse=True)
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


def causal_inputs(n: int, seed: int) -> Inputs:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def gpt2() -> tuple[torch.nn.Module, Callable[[int, int], Inputs]]:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    model.transformer.h[2] = poptorch.BeginBlock(model.transformer.h[2], ipu_id=1)
    return model, causal_inputs


def llama() -> tuple[torch.nn.Module, Callable[[int, int], Inputs]]:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=4, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=SEQ)
    model = transformers.LlamaForCausalLM(config)
    model.model.layers[2] = poptorch.BeginBlock(model.model.layers[2], ipu_id=1)
    return model, causal_inputs


def t5() -> tuple[torch.nn.Module, Callable[[int, int], Inputs]]:
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                   num_decoder_layers=2, num_heads=2, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    model.decoder.block[0] = poptorch.BeginBlock(model.decoder.block[0], ipu_id=1)

    def inputs(n: int, seed: int) -> Inputs:
        g = torch.Generator().manual_seed(seed)
        return {"input_ids": torch.randint(1, VOCAB, (n, SEQ), generator=g),
                "labels": torch.randint(1, VOCAB, (n, SEQ // 2), generator=g)}

    return model, inputs


def without_cache(output: Any) -> Any:
    return pytree.tree_map(lambda x: None if isinstance(x, transformers.Cache) else x, output)


@pytest.mark.parametrize("build", [gpt2, llama, t5], ids=["gpt2", "llama", "t5"])
def test_default_config_trains_split_like_plain_pytorch(request, caplog, build):
    torch.manual_seed(0)
    model, make_inputs = build()
    assert model.config.use_cache  # the config as it comes
    plain = twin(model)
    wrapper = cleaned(request, poptorch.trainingModel(model, options(sharded=False, G=G),
                                                      optimizer=sgd(model)))
    plain_optimizer = sgd(plain)
    caplog.set_level(logging.INFO, logger="pipetorch.partition.export")
    for call in range(CALLS):
        inputs = make_inputs(D * G * B, call)
        got = wrapper(**inputs)
        # Plain PyTorch returns the cache too; the split model returns everything else.
        want = plain_call(lambda **kw: without_cache(plain(**kw)), plain_optimizer, inputs,
                          D=D, G=G, B=B)
        assert "past_key_values" not in got
        assert_same_output(got, want, what=f"{build.__name__} call {call}")
    dropped = [r for r in caplog.records if "use_cache=True" in r.getMessage()]
    assert len(dropped) == 1, [r.getMessage() for r in caplog.records]
    assert_same_state(wrapper.model, plain, what=f"{build.__name__}: ")


def test_split_inference_with_the_cache_says_to_turn_it_off(request):
    torch.manual_seed(0)
    model, make_inputs = gpt2()
    wrapper = cleaned(request, poptorch.inferenceModel(model, options(sharded=False, G=1)))
    inputs = make_inputs(D * B, 0)
    with pytest.raises(poptorch.Error, match=r"DynamicCache.*use_cache = False"):
        wrapper(input_ids=inputs["input_ids"])
    model.config.use_cache = False
    again = cleaned(request, poptorch.inferenceModel(model, options(sharded=False, G=1)))
    logits = again(input_ids=inputs["input_ids"]).logits
    assert logits.shape == (D * B, SEQ, VOCAB)
