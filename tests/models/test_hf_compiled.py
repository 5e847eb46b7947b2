"""A HuggingFace BERT split with BeginBlock trains through torch.compile'd stages as in eager."""
from __future__ import annotations

import pytest

import pipetorch as poptorch
from pipetorch.parallel.worker.compiled import CompiledStage
from hf_cases import BUILDERS, plain_call, twin
from parallel.parallel_cases import assert_same_state, cleaned, one_thread_everywhere
from test_hf_pipelined import B, D, assert_same_output, options, sgd

pytestmark = [pytest.mark.slow, pytest.mark.transformers]


def test_compiled_bert_stages_train_like_plain_pytorch(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)
    case = BUILDERS["bert-seed003"](2)
    plain = twin(case.model)
    G = 3
    opts = options(sharded=False, G=G)
    opts.Jit.compileStages(True, backend="aot_eager")  # inductor's C++ builds take minutes here
    wrapper = cleaned(request, poptorch.trainingModel(case.model, opts, optimizer=sgd(case.model)))
    plain_optimizer = sgd(plain)
    for call in range(2):
        inputs = case.make_inputs(D * G * B, call)
        want = plain_call(plain, plain_optimizer, inputs, D=D, G=G, B=B, loss_at=case.loss_at)
        assert_same_output(wrapper(**inputs), want, what=f"compiled bert call {call}")
    # what each worker was sent (a stage pickles with its backend and compiles in the worker)
    modules = wrapper._compiled.engine.staged.modules
    assert [(type(m), m.backend) for m in modules] == [(CompiledStage, "aot_eager")] * 2
    assert_same_state(wrapper.model, plain, what="compiled bert: ")
