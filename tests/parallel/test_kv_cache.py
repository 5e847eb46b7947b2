"""Key/value caches split by stage: what crosses processes, and the lengths a worker mirrors."""
from __future__ import annotations

import pytest
import torch

from pipetorch.parallel.generation import kv_cache

transformers = pytest.importorskip("transformers")


def cache_of(layers: int, held: range, length: int) -> "transformers.DynamicCache":
    config = transformers.GPT2Config(n_layer=layers, n_head=2, n_embd=8)
    cache = transformers.DynamicCache(config=config)
    for layer in held:
        cache.update(torch.randn(1, 2, length, 4), torch.randn(1, 2, length, 4), layer)
    return cache


def test_a_worker_mirrors_the_lengths_of_layers_it_does_not_hold():
    first, second = cache_of(4, range(0, 2), 7), cache_of(4, range(2, 4), 7)
    # Stage 1's forward reads layer 0 for positions and mask width: empty there.
    assert second.get_seq_length() == 0
    kv_cache.mirror(second, kv_cache.held_shapes(first))
    assert second.get_seq_length() == 7 and second.get_mask_sizes(1, 0) == (8, 0)
    assert second.layers[0].keys.device.type == "meta"  # no memory for another's layer
    assert set(kv_cache.held_shapes(second)) == {"2", "3"}  # its own layers only
    second.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), 2)  # its layers grow
    kv_cache.mirror(second, {**kv_cache.held_shapes(first), "0": ((1, 2, 8, 4), torch.float32)})
    assert second.get_seq_length() == 8 and second.get_seq_length(2) == 8


def test_caches_stay_in_their_process_and_come_back_filled():
    cache = cache_of(2, range(2), 3)
    call = ((torch.ones(2, 1),), {"past_key_values": cache, "use_cache": True})
    stripped = kv_cache.strip(call)
    assert isinstance(stripped[1]["past_key_values"], kv_cache.CacheSlot)
    assert kv_cache.has_slot(stripped) and kv_cache.find(stripped) is None
    assert kv_cache.fill(stripped, cache)[1]["past_key_values"] is cache
    assert kv_cache.find(call) is cache


def test_a_cache_whose_layers_cannot_be_mirrored_is_refused():
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=8)
    cache = transformers.StaticCache(config=config, max_cache_len=8)
    with pytest.raises(NotImplementedError, match="DynamicCache"):
        kv_cache.mirror(cache, {"0": ((1, 2, 3, 4), torch.float32)})
