"""What a stage gives in place of an earlier stage's module result during generate(): zeros of
that result's structure, shapes and dtypes, which hold no memory (a prompt's hidden states
each, otherwise) and which the model's code cannot write into unnoticed."""
from types import SimpleNamespace

import pytest
import torch

from pipetorch.parallel.generation.eager_stage import EagerStage, Like


def test_an_earlier_stages_result_is_zeros_of_its_structure_holding_no_memory():
    hidden = Like((8, 512, 768), torch.float32)
    result = (hidden, {"present": (Like((8, 12, 512, 64), torch.float16), None)}, 3)
    stage = SimpleNamespace(device=torch.device("cpu"))
    got = EagerStage._zeroed(stage, result)
    states, rest, three = got
    key = rest["present"][0]
    assert three == 3 and rest["present"][1] is None
    assert states.shape == (8, 512, 768) and states.dtype == torch.float32
    assert key.shape == (8, 12, 512, 64) and key.dtype == torch.float16
    assert not states.any() and not key.any()
    # one element each, where real zeros would be 12 MB and 6 MB
    assert states.untyped_storage().nbytes() == 4 and key.untyped_storage().nbytes() == 2
    with pytest.raises(RuntimeError, match="single memory location"):
        states.add_(1.0)  # written in place by mistake: an error, never a silent wrong value
