"""Issue 32 E: a later call's inputs that differ from the first call's, refused with the words
PopTorch's inputs_test.py matches ("expected torch.float32 but got torch.int64", "Missing
arguments: m.", ...), and optional inputs given or left to their defaults (also of a half
model) as one input signature, as PopTorch's arguments parser fills defaults in."""
import re

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch


class TupleAdder(nn.Module):
    def forward(self, t):
        x, y = t
        return x + y


def test_a_changed_dtype_is_poptorchs_error_and_destroy_recompiles():
    model = poptorch.inferenceModel(TupleAdder())
    assert float(model((torch.tensor([1.]), torch.tensor([2.])))) == 3.0
    t1, t2 = torch.tensor([1]), torch.tensor([2])
    with pytest.raises(poptorch.Error, match=".*expected torch.float32 but got torch.int64.*"):
        model((t1, t2))
    model.destroy()
    assert int(model((t1, t2))) == 3


def test_a_changed_shape_is_poptorchs_error_and_destroy_recompiles():
    module = TupleAdder()
    model = poptorch.inferenceModel(module)
    model((torch.tensor([1.]), torch.tensor([2.])))
    t1, t2 = torch.tensor([1., 1.]), torch.tensor([2., 2.])
    with pytest.raises(poptorch.Error,
                       match=re.escape("expected torch.Size([1]) but got torch.Size([2])")):
        model((t1, t2))
    model.destroy()
    for _ in range(2):
        assert_close(model((t1, t2)), module((t1, t2)))


@pytest.mark.parametrize("use_half", [True, False])
def test_optional_inputs_given_or_left_to_their_defaults(use_half):
    dtype = torch.float16 if use_half else torch.float32

    class Adder(nn.Module):
        def forward(self, t1, t2, t3=torch.ones(1, dtype=dtype), t4=torch.zeros(1, dtype=dtype)):
            return t1 * t3 + t2 * t4

    module = Adder()
    model = poptorch.inferenceModel(module)
    t1, t2, t4 = torch.tensor([1.]), torch.tensor([2.]), torch.tensor([4.])
    if use_half:
        module.half()
        t1, t2, t4 = t1.half(), t2.half(), t4.half()
    out = model(t1, t2)
    assert out.dtype == dtype and float(out) == 1.0
    assert float(model(t1, t2, t4=t4)) == 9.0
    assert float(model(t4=t4, t1=t1, t2=t2)) == 9.0


class Many(nn.Module):
    def forward(self, a, b, *c, y=None, z=None, t=None, u=3, v="op", **w):
        r = len(v) * b + a * len(w)
        for i, x in enumerate(c):
            r += (i + 1) * x
        if y is not None:
            r = torch.add(r, y) * 3
        if z is not None:
            r = torch.add(r, z) * 4
        if t is not None:
            r = torch.add(r, t) * 5
        return u * r


class Forwarding(Many):
    def forward(self, *args, **kwargs):  # pylint: disable=signature-differs
        return super().forward(*args, **kwargs)


@pytest.mark.parametrize("forwarding", [False, True])
def test_arguments_a_later_call_leaves_out_or_changes(forwarding):
    module = Forwarding() if forwarding else Many()
    model = poptorch.inferenceModel(module)
    torch.manual_seed(0)
    a = 2
    b, c, d, e, t, x, m, z = (torch.randn(2, 2) for _ in range(8))
    for _ in range(2):
        assert_close(model(a, b, c, d, e, t=t, x=x, m=m, z=z),
                     module(a, b, c, d, e, t=t, x=x, m=m, z=z))
    # Left out, z takes forward's default None; a forward taking **kwargs just lacks it.
    missing_z = ("Missing arguments: z." if forwarding
                 else "Type mismatch for z: expected .*Tensor.* but got .*None")
    with pytest.raises(poptorch.Error, match=missing_z):
        model(a, b, c, d, e, t=t, x=x, m=m)
    with pytest.raises(poptorch.Error, match="Keys mismatch for named arguments: Missing "
                                             "arguments: m."):
        model(a, b, c, d, e, t=t, x=x, z=z)
    model.destroy()
    kwargs = dict(t=t, x=x, m=m, z=z, v="foobar")
    assert_close(model(a, b, c, d, e, u=5, **kwargs), module(a, b, c, d, e, u=5, **kwargs))
    with pytest.raises(poptorch.Error, match="mismatch for u: expected 5 but got 3"):
        model(a, b, c, d, e, u=3, **kwargs)
    with pytest.raises(poptorch.Error, match="Number of positional arguments mismatch: "
                                             "expected 5 arguments but got 4"):
        model(a, b, c, e, u=5, **kwargs)
    with pytest.raises(poptorch.Error, match="Number of positional arguments mismatch: "
                                             "expected 5 arguments but got 2"):
        model(a, b, u=5, **kwargs)
    model.destroy()
    if not forwarding:
        with pytest.raises(poptorch.Error, match="Mandatory parameter b missing"):
            model(a)
    assert_close(model(a, b), module(a, b))


def test_keyword_and_tuple_changes_use_poptorchs_words():
    # PopTorch's python/_args_parser.py: "Keys mismatch for named arguments: Unexpected
    # arguments: n" and "Length mismatch for t: expected 2 elements but got 3".
    module = Many()
    model = poptorch.inferenceModel(module)
    b, m, n = torch.ones(2), torch.ones(2), torch.ones(2)
    model(2, b, m=m)
    with pytest.raises(poptorch.Error, match="Keys mismatch for named arguments: Unexpected "
                                             "arguments: n. "):
        model(2, b, m=m, n=n)
    with pytest.raises(poptorch.Error, match="Keys mismatch for named arguments: Unexpected "
                                             "arguments: n. Missing arguments: m. "):
        model(2, b, n=n)
    tuples = poptorch.inferenceModel(TupleAdder())
    tuples((torch.ones(1), torch.ones(1)))
    with pytest.raises(poptorch.Error, match="Length mismatch for t: expected 2 elements but "
                                             "got 3"):
        tuples((torch.ones(1), torch.ones(1), torch.ones(1)))
