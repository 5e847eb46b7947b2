"""HuggingFace models split with BeginBlock train in worker processes as plain PyTorch does."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from torch.utils import _pytree as pytree

import pipetorch as poptorch
from hf_cases import BUILDERS, gpt2, join, plain_call, slice_inputs, twin
from parallel.parallel_cases import assert_same_state, cleaned, one_thread_everywhere

pytestmark = [pytest.mark.slow, pytest.mark.transformers]

D, B, CALLS = 2, 2, 2


@pytest.fixture(autouse=True)
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


def options(*, sharded: bool, G: int, D: int = D, auto_increment: bool = False,
            mode: poptorch.OutputMode = poptorch.OutputMode.All) -> poptorch.Options:
    opts = poptorch.Options().deviceIterations(D).outputMode(mode)
    opts.Training.gradientAccumulation(G)
    stages = poptorch.AutoStage.AutoIncrement if auto_increment else poptorch.AutoStage.SameAsIpu
    strategy = poptorch.ShardedExecution if sharded else poptorch.PipelinedExecution
    opts.setExecutionStrategy(strategy(stages))
    return opts.showCompilationProgressBar(False)


def assert_same_output(got, want, *, what: str) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert type(got) is type(want) and got_spec == want_spec, f"{what}: {got_spec} != {want_spec}"
    for index, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        assert_close(g.as_subclass(torch.Tensor), w, msg=lambda m, i=index: f"{what}[{i}]: {m}")


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


# Each model pipelined over 2 devices, BERT also over 4 and sharded; the tutorial's
# AutoIncrement places each block on its ipu_id.
TRAINING = [
    pytest.param("bert-seed003", 2, False, False, id="bert-seed003-2-pipelined"),
    pytest.param("bert-seed003", 4, False, False, id="bert-seed003-4-pipelined"),
    pytest.param("bert-seed003", 2, True, False, id="bert-seed003-2-sharded"),
    pytest.param("bert-tutorial", 2, True, True, id="bert-tutorial-2-sharded-autoincrement"),
    pytest.param("gpt2", 2, False, False, id="gpt2-2-pipelined"),
    pytest.param("vit", 2, False, False, id="vit-2-pipelined"),
    pytest.param("vit", 4, True, False, id="vit-4-sharded"),
    pytest.param("shape-branching", 2, False, False, id="shape-branching-2-pipelined"),
]


@pytest.mark.parametrize("name, devices, sharded, auto_increment", TRAINING)
def test_training_matches_plain_pytorch(request, name, devices, sharded, auto_increment):
    case = BUILDERS[name](devices)
    plain = twin(case.model)
    G = devices if sharded else 2 * devices - 1
    batches = [case.make_inputs(D * G * B, seed) for seed in range(CALLS)]
    opts = options(sharded=sharded, G=G, auto_increment=auto_increment)
    wrapper = cleaned(request, poptorch.trainingModel(case.model, opts, optimizer=sgd(case.model)))
    plain_optimizer = sgd(plain)
    for call, inputs in enumerate(batches):
        got = wrapper(**inputs)
        want = plain_call(plain, plain_optimizer, inputs, D=D, G=G, B=B, loss_at=case.loss_at)
        assert_same_output(got, want, what=f"{name} call {call}")
    # one worker per device, running every stage on it (the tutorial: several per device)
    assert len(wrapper._compiled.engine.worker_pids) == devices
    assert len({s.ipu_id for s in wrapper._compiled.stages}) == devices
    assert len(wrapper._compiled.stages) > devices or not auto_increment
    assert_same_state(wrapper.model, plain, what=f"{name}: ")


@pytest.mark.parametrize("name", ["bert-seed003", "vit"])
def test_inference_logits_equal_the_plain_model(request, name):
    case = BUILDERS[name](2)
    case.model.eval()
    plain = twin(case.model)
    opts = options(sharded=False, G=1, D=2)
    wrapper = cleaned(request, poptorch.inferenceModel(case.model, opts))
    inputs = case.make_inputs(2 * B, 5)
    # At inference the QA model gets no positions (None), the classifier no labels.
    for key in ("start_positions", "end_positions", "labels"):
        inputs.pop(key, None)
    got = wrapper(**inputs)
    with torch.no_grad():
        want = join([plain(**slice_inputs(inputs, i * B, (i + 1) * B)) for i in range(2)])
    assert_same_output(got, want, what=name)


def test_gpt2_tied_embeddings_across_two_devices_train_like_plain_pytorch(request):
    # GPT-2 ties lm_head.weight to wte.weight, with wte on device 0 and the head on device 1:
    # each device holds a copy, their gradients are summed before every step (DeepSpeed's
    # tied layers), and the user's model keeps one weight.
    case = gpt2(2, tied=True)
    plain = twin(case.model)
    G = 3
    opts = options(sharded=False, G=G)
    wrapper = cleaned(request, poptorch.trainingModel(case.model, opts, optimizer=sgd(case.model)))
    plain_optimizer = sgd(plain)
    for call in range(CALLS):
        inputs = case.make_inputs(D * G * B, call)
        want = plain_call(plain, plain_optimizer, inputs, D=D, G=G, B=B, loss_at=case.loss_at)
        assert_same_output(wrapper(**inputs), want, what=f"gpt2 tied across devices call {call}")
    assert [p.stages for p in wrapper._compiled.engine.placements] == [(0,), (1,)]
    wrapper.copyWeightsToHost()
    assert wrapper.model.lm_head.weight is wrapper.model.transformer.wte.weight
    assert_same_state(wrapper.model, plain, what="gpt2 tied across devices: ")


def test_gpt2_tied_embeddings_with_the_head_back_on_device_0_train_like_plain_pytorch(request):
    # Graphcore's layout for tied language models: the head returns to the embedding's device
    # (ipus 0, 1, 0), whose worker holds the one weight both stages use and update once.
    case = gpt2(2, tied=True)
    case.model.lm_head = poptorch.BeginBlock(case.model.lm_head, ipu_id=0)
    plain = twin(case.model)
    G = 3
    opts = options(sharded=True, G=G, auto_increment=True)
    wrapper = cleaned(request, poptorch.trainingModel(case.model, opts, optimizer=sgd(case.model)))
    plain_optimizer = sgd(plain)
    for call in range(CALLS):
        inputs = case.make_inputs(D * G * B, call)
        want = plain_call(plain, plain_optimizer, inputs, D=D, G=G, B=B, loss_at=case.loss_at)
        assert_same_output(wrapper(**inputs), want, what=f"gpt2 tied call {call}")
    assert [p.stages for p in wrapper._compiled.engine.placements] == [(0, 2), (1,)]
    assert wrapper.model.lm_head.weight is wrapper.model.transformer.wte.weight
    assert_same_state(wrapper.model, plain, what="gpt2 tied: ")
