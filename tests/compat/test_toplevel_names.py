"""Issue 17, group 1: PopTorch's top-level names, each as PopTorch's documentation describes it."""
import itertools
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import TinyMLP, data


# -- setLogLevel / logger -----------------------------------------------------------------
def test_set_log_level_names_and_legacy_integers():
    before = poptorch.logger.level
    try:
        poptorch.setLogLevel("DEBUG")
        assert poptorch.logger.getEffectiveLevel() == logging.DEBUG
        # a module logger of the library follows the top-level level
        assert logging.getLogger("pipetorch.runtime.executor").isEnabledFor(logging.DEBUG)
        poptorch.setLogLevel(4)  # legacy integer: ERR
        assert poptorch.logger.level == logging.ERROR
        poptorch.setLogLevel("OFF")
        assert not poptorch.logger.isEnabledFor(logging.CRITICAL)
        with pytest.raises(ValueError, match="Unknown log level: LOUD. Valid values are"):
            poptorch.setLogLevel("LOUD")
        with pytest.raises(ValueError, match="Invalid log level integer"):
            poptorch.setLogLevel(5)
    finally:
        poptorch.logger.setLevel(before)


def test_set_log_level_prints_info_messages_in_a_plain_script():
    # Without a handler Python prints only warnings: setLogLevel("INFO") must show INFO lines.
    script = ("import logging, pipetorch as poptorch\n"
              "poptorch.setLogLevel('INFO')\n"
              "logging.getLogger('pipetorch.runtime').info('compiled it')\n"
              "logging.getLogger('pipetorch.runtime').debug('hidden')\n")
    root = os.path.dirname(os.path.dirname(poptorch.__file__))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert result.returncode == 0, result.stderr
    assert "[pipetorch.runtime] [info] compiled it" in result.stderr  # PopTorch: lower case
    assert "hidden" not in result.stderr


# -- ICustomArgParser ----------------------------------------------------------------------
class Pair:
    """A user's input type holding two tensors."""

    def __init__(self, a, b):
        self.a, self.b = a, b


class PairParser(poptorch.ICustomArgParser):
    def yieldTensors(self, struct):
        yield struct.a
        yield struct.b

    def reconstruct(self, original_structure, tensor_iterator):
        return Pair(next(tensor_iterator), next(tensor_iterator))


class PairModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, pair):
        return self.fc(pair.a) * pair.b


def test_custom_arg_parser_splits_a_custom_input_like_tensors():
    poptorch.registerCustomArgParser(Pair, PairParser())
    torch.manual_seed(0)
    model = PairModel()
    a, b = torch.randn(8, 4), torch.randn(8, 2)
    opts = poptorch.Options().deviceIterations(4)  # the 8 rows run as 4 micro-batches of 2
    wrapped = poptorch.inferenceModel(model, opts)
    assert_close(wrapped(Pair(a, b)), model(Pair(a, b)))
    # a fresh object of the same type is the same input signature
    assert_close(wrapped(Pair(a + 1, b)), model(Pair(a + 1, b)))
    with pytest.raises(TypeError, match="ICustomArgParser subclass"):
        poptorch.registerCustomArgParser(Pair, object())


class PairDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.a, self.b = torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)

    def __len__(self):
        return len(self.a)

    def __getitem__(self, i):
        return Pair(self.a[i], self.b[i])


def collate_pairs(items):
    return Pair(torch.stack([p.a for p in items]), torch.stack([p.b for p in items]))


@pytest.mark.slow  # the asynchronous loader runs in its own process
@pytest.mark.parametrize("mode", [poptorch.DataLoaderMode.Sync, poptorch.DataLoaderMode.Async])
def test_custom_arg_parser_carries_a_custom_type_through_the_data_loader(mode):
    poptorch.registerCustomArgParser(Pair, PairParser())
    torch.manual_seed(0)
    model = PairModel()
    opts = poptorch.Options().deviceIterations(2)
    dataset = PairDataset(8)
    loader = poptorch.DataLoader(opts, dataset, batch_size=2, collate_fn=collate_pairs,
                                 mode=mode)
    wrapped = poptorch.inferenceModel(model, opts)
    outputs = [wrapped(batch) for batch in loader]
    if hasattr(loader, "terminate"):
        loader.terminate()
    assert_close(torch.cat(outputs), model(Pair(dataset.a, dataset.b)))


# -- compile hooks -------------------------------------------------------------------------
def test_pre_and_post_compile_hooks_run_around_compilation_and_can_be_removed():
    calls = []
    pre = poptorch.registerPreCompileHook(lambda: calls.append("pre"))
    post = poptorch.registerPostCompileHook(lambda: calls.append("post"))
    try:
        x, _ = data(4)
        wrapped = poptorch.inferenceModel(TinyMLP())
        wrapped(x)
        wrapped(x)  # compiled once: hooks ran once
        assert calls == ["pre", "post"]
    finally:
        pre.remove()
        post.remove()
    poptorch.inferenceModel(TinyMLP())(x)
    assert calls == ["pre", "post"]
    with pytest.raises(RuntimeError, match="Pre-compile hook must be callable"):
        poptorch.registerPreCompileHook(3)


# -- printing ------------------------------------------------------------------------------
def test_module_repr_shows_begin_block_and_the_wrapper_prints_it():
    model = TinyMLP()
    poptorch.BeginBlock(model.fc2, "second", ipu_id=1)
    text = poptorch.module_repr(model)
    assert "(fc2): BeginBlock(user_id=second, ipu_id=1) Linear(in_features=8, " in text
    assert "(fc1): Linear(in_features=6, out_features=8, bias=True)" in text
    assert text.startswith("TinyMLP(\n")
    wrapped = poptorch.inferenceModel(model)
    assert "BeginBlock(user_id=second, ipu_id=1)" in repr(wrapped)
    # without blocks, module_repr is torch's repr
    plain = TinyMLP()
    assert poptorch.module_repr(plain) == repr(plain)


# -- accessAttributes / createPoptorchError ------------------------------------------------
def test_access_attributes_and_create_poptorch_error():
    from pipetorch.extensions import register_attributes

    attrs = {"alpha": 0.5}
    assert poptorch.accessAttributes(register_attributes(attrs)) is attrs
    assert poptorch.accessAttributes('{"k": 1}') == {"k": 1}
    with pytest.raises(ValueError, match="Wrong type for attribute_id_str"):
        poptorch.accessAttributes(3)
    with pytest.raises(ValueError, match="Invalid attribute_id_str"):
        poptorch.accessAttributes("nonsense")
    error = poptorch.createPoptorchError("bad thing")
    assert isinstance(error, poptorch.Error)
    assert (error.type, error.message, error.location) == ("poptorch_py_error", "bad thing", "")
    assert str(error) == "'poptorch_py_error': bad thing"


# -- profiling.Channel ---------------------------------------------------------------------
def test_profiling_channel_records_tracepoints_and_instrumented_methods():
    from pipetorch.profiling.channel import clear_spans, recorded_spans

    clear_spans()
    channel = poptorch.profiling.Channel("mine")
    with channel.tracepoint("step"):
        sum(range(100))
    dataset = channel.instrument(torch.utils.data.TensorDataset(torch.arange(4)), "__getitem__")
    assert dataset[2][0] == 2
    spans = recorded_spans("mine")
    assert [s.name for s in spans] == ["step", "TensorDataset.__getitem__"]
    assert all(s.end_ns >= s.start_ns for s in spans)


# -- ops -----------------------------------------------------------------------------------
def test_dynamic_slice_and_update_match_python_slicing():
    x = torch.arange(24.).reshape(4, 6)
    start = torch.tensor([1])
    assert_close(poptorch.dynamic_slice(x, 1, start, 4, 2), x[:, 1:5:2])
    assert_close(poptorch.dynamic_slice(x, 0, torch.tensor(2), 2, 1), x[2:4])
    src = -torch.ones(4, 2)
    expected = x.clone()
    expected[:, 3:5] = src
    assert_close(poptorch.dynamic_update(x, src, 1, torch.tensor(3), 2), expected)
    with pytest.raises(poptorch.Error, match="must be a torch.tensor"):
        poptorch.dynamic_slice(x, 0, 1, 2, 1)
    with pytest.raises(poptorch.Error, match="same dtype"):
        poptorch.dynamic_update(x, src.int(), 1, torch.tensor(3), 2)
    with pytest.raises(poptorch.Error, match="outside the dimension of size 6"):
        poptorch.dynamic_slice(x, 1, torch.tensor(5), 4, 1)


class SliceAndUpdate(nn.Module):
    def forward(self, x, start):
        window = poptorch.dynamic_slice(x, 1, start, 3, 1)
        return poptorch.dynamic_update(torch.zeros_like(x), window * 2, 1, start, 3)


def test_dynamic_ops_trace_with_a_run_time_start():
    # A split model is captured with torch.export: start must stay a run-time value.
    x, start = torch.arange(12.).reshape(2, 6), torch.tensor([2])
    exported = torch.export.export(SliceAndUpdate(), (x, start)).module()
    expected = torch.zeros_like(x)
    expected[:, 1:4] = 2 * x[:, 1:4]
    assert_close(exported(x, torch.tensor([1])), expected)


@pytest.mark.parametrize("mode", list(poptorch.MatMulSerializationMode))
def test_serialized_matmul_equals_matmul_with_gradients(mode):
    torch.manual_seed(0)
    lhs = torch.randn(4, 6, requires_grad=True)
    rhs = torch.randn(6, 8, requires_grad=True)
    out = poptorch.serializedMatMul(lhs, rhs, mode, 2)
    out.sum().backward()
    grads = lhs.grad.clone(), rhs.grad.clone()
    lhs.grad = rhs.grad = None
    (lhs @ rhs).sum().backward()
    assert_close(out, lhs @ rhs)
    assert_close(grads, (lhs.grad, rhs.grad))
    with pytest.raises(ValueError, match="factor \\(5\\) must divide"):
        poptorch.serializedMatMul(lhs, rhs, poptorch.MatMulSerializationMode.ReducingDim, 5)


def test_serialized_matmul_keep_precision_sums_half_partials_in_float():
    torch.manual_seed(0)
    lhs, rhs = torch.randn(2, 64).half(), torch.randn(64, 2).half()
    out = poptorch.serializedMatMul(lhs, rhs, poptorch.MatMulSerializationMode.ReducingDim,
                                    4, keep_precision=True)
    assert out.dtype == torch.float16
    assert_close(out.float(), lhs.float() @ rhs.float(), atol=0.05, rtol=0.01)


def test_set_overlap_markers_return_their_inputs():
    x, y = torch.ones(2), torch.zeros(3)
    mode = poptorch.OverlapMode.OverlapAccumulationLoop
    assert poptorch.set_overlap_for_input(x, mode) is x
    out = poptorch.set_overlap_for_output({"a": x, "b": (y,)}, mode)
    assert out["a"] is x and out["b"][0] is y
    with pytest.raises(poptorch.Error, match="only set overlap for torch.tensor inputs"):
        poptorch.set_overlap_for_input([x, 3], mode)


def _brute_force_ctc(log_probs, blank):
    """Every alignment enumerated, collapsed, its probability summed per label sequence."""
    steps, classes = log_probs.shape
    totals = {}
    for path in itertools.product(range(classes), repeat=steps):
        labels = tuple(c for i, c in enumerate(path) if c != blank and (i == 0 or c != path[i - 1]))
        p = math.exp(sum(log_probs[t, c].item() for t, c in enumerate(path)))
        totals[labels] = totals.get(labels, 0.0) + p
    return sorted(totals.items(), key=lambda kv: kv[1], reverse=True)


def test_ctc_beam_search_decoder_finds_the_most_likely_label_sequences():
    torch.manual_seed(0)
    log_probs = torch.randn(4, 2, 3).log_softmax(-1)  # [T, B, C]
    lengths = torch.tensor([4, 3])
    probs, lens, paths = poptorch.ctc_beam_search_decoder(log_probs, lengths, blank=0,
                                                           beam_width=50, top_paths=2)
    assert probs.shape == (2, 2) and lens.shape == (2, 2) and paths.shape == (2, 2, 4)
    for b in range(2):
        expected = _brute_force_ctc(log_probs[:lengths[b], b], blank=0)[:2]
        for k, (labels, p) in enumerate(expected):
            assert tuple(paths[b, k, :lens[b, k]].tolist()) == labels
            assert math.isclose(probs[b, k].exp().item(), p, rel_tol=1e-5)


def test_custom_op_says_it_needs_an_ipu_and_what_runs_instead():
    with pytest.raises(poptorch.errors.IpuOnlyError, match="write the op in PyTorch|Write the op"):
        poptorch.custom_op([torch.ones(2)], "LeakyRelu", "custom.ops", 1,
                           example_outputs=[torch.ones(2)], attributes={"alpha": 0.1})
    assert issubclass(poptorch.errors.IpuOnlyError, NotImplementedError)
