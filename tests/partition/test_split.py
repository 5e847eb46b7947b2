"""Splitting a traced forward into stage modules: same numbers, own weights, routed values."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pipetorch as poptorch
from helpers.models import MnistNetwork, WithLoss, mnist_data
from helpers.zoo import Bottleneck, ResNet, TransformerClassifier, image_data, token_data
from pipetorch.errors import CompileError
from pipetorch.partition import blocks
from pipetorch.partition.split import split_stages
from pipetorch.partition.strategies import StageSpec


def specs(*groups):
    """One StageSpec per group; a group is a block id or a tuple of them."""
    return [StageSpec(i, i, (g,) if isinstance(g, str) else tuple(g)) for i, g in enumerate(groups)]


def begin_specs(model):
    """Stage 0 for the ops before the first BeginBlock, then one stage per BeginBlock."""
    ids = [user_id for user_id, _ in blocks.begin_blocks(model).values()]
    return specs((), *[(b,) for b in ids])


def leaves(value):
    return list(value) if isinstance(value, tuple) else [value]


def assert_same_as_unsplit(model, args, kwargs, stages):
    """Split `model` and check outputs, loss, gradients and buffers against a copy run whole."""
    reference = copy.deepcopy(model)
    staged = split_stages(model, args, kwargs, stages)
    expected, got = reference(*args, **kwargs), staged.run(*args, **kwargs)
    assert type(got) is type(expected) and len(leaves(got)) == len(leaves(expected))
    for e, g in zip(leaves(expected), leaves(got)):
        assert torch.equal(e, g)
    leaves(expected)[-1].sum().backward()
    leaves(got)[-1].sum().backward()
    for (name, p), (ref_name, ref_p) in zip(model.named_parameters(), reference.named_parameters()):
        assert name == ref_name and torch.equal(p.grad, ref_p.grad), name
    for (name, b), (_, ref_b) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(b, ref_b), name
    return staged


def stage_parameter_names(staged):
    return [[name for name, _ in module.named_parameters()] for module in staged.modules]


def assert_partition(staged, model, stage_of_name):
    """Each stage holds exactly the parameters `stage_of_name` gives it, all of them once."""
    names = stage_parameter_names(staged)
    for index, owned in enumerate(names):
        expected = [n for n, _ in model.named_parameters() if stage_of_name(n) == index]
        assert sorted(owned) == sorted(expected), index
    assert sum(len(n) for n in names) == len(list(model.parameters()))
    stage_params = [p for module in staged.modules for p in module.parameters()]
    assert {id(p) for p in stage_params} == {id(p) for p in model.parameters()}


@pytest.mark.parametrize("groups", [(("B1", "B2"), ("B3", "B4")),
                                    (("B1",), ("B2",), ("B3",), ("B4",))])
def test_seed_cnn_split_matches_unsplit(groups):
    torch.manual_seed(0)
    model = WithLoss(MnistNetwork())
    x, y = mnist_data(4)
    staged = assert_same_as_unsplit(model, (x,), {"labels": y}, specs(*groups))
    block_of = {"layer1": "B1", "layer2": "B2", "layer3": "B3", "layer4": "B4"}
    stage_of_block = {b: i for i, g in enumerate(groups) for b in g}
    assert_partition(staged, model, lambda n: stage_of_block[block_of[n.split(".")[1]]])
    last = len(groups) - 1
    # Seed 000 returns (output, loss): both are made in B4's stage.
    assert staged.output == (("stage", last, 0), ("stage", last, 1))
    assert staged.io[last].inputs == (("stage", last - 1, 0), ("input", 1))


def test_seed_cnn_without_labels_returns_the_output_only():
    torch.manual_seed(0)
    model = WithLoss(MnistNetwork())
    x, _ = mnist_data(3)
    staged = assert_same_as_unsplit(model, (x,), {}, specs(("B1", "B2"), ("B3", "B4")))
    assert staged.output == ("stage", 1, 0)
    assert staged.layout.constants == {"labels": None}
    with pytest.raises(ValueError,
                       match="labels=a tensor of shape \\(3,\\).*traced with labels=None"):
        staged.run(x, labels=torch.zeros(3, dtype=torch.long))


def test_labels_given_positionally_or_by_keyword_are_the_same_input():
    torch.manual_seed(0)
    model = WithLoss(MnistNetwork())
    x, y = mnist_data(2)
    staged = split_stages(model, (x, y), {}, specs(("B1", "B2"), ("B3", "B4")))
    assert staged.flatten_inputs(x, labels=y)[1] is y
    assert torch.equal(staged.run(x, labels=y)[1], staged.run(x, y)[1])
    with pytest.raises(ValueError, match="labels=None but its stages were traced with a tensor"):
        staged.run(x)


def position(name):
    """Where a ResNet parameter runs: (layer, block) ordered like forward; stem 0, fc last."""
    part = name.split(".")[1:]
    if part[0].startswith("layer"):
        return int(part[0][5]), int(part[1])
    return (5, 0) if part[0] == "fc" else (0, 0)


@pytest.mark.parametrize("starts", [("layer3.1",), ("layer2.0", "layer3.1", "layer4.0")])
def test_resnet_split_at_begin_blocks_matches_unsplit(starts):
    torch.manual_seed(0)
    net = ResNet(layers=(1, 1, 2, 1), width=4)
    for ipu, name in enumerate(starts, start=1):
        layer, index = getattr(net, name.split(".")[0]), int(name.split(".")[1])
        # like seed 002: model.layer3[8] = poptorch.BeginBlock(model.layer3[8], ipu_id=1)
        layer[index] = poptorch.BeginBlock(layer[index], ipu_id=ipu)
    model = WithLoss(net, block=None)
    x, y = image_data(4)
    staged = assert_same_as_unsplit(model, (x, y), {}, begin_specs(net))
    assert_partition(staged, model,
                     lambda n: sum(position(n) >= position("model." + s) for s in starts))
    # BatchNorm statistics live with their layer's stage.
    assert staged.owners["model.bn1.running_mean"] == (0,)
    assert staged.owners["model.layer4.0.bn1.running_var"] == (len(starts),)
    assert staged.tied() == {}


def test_bottleneck_resnet_in_eval_mode():
    torch.manual_seed(0)
    net = ResNet(Bottleneck, (1, 1, 1, 1), width=4)
    net.layer3[0] = poptorch.BeginBlock(net.layer3[0], ipu_id=1)
    net.eval()
    x, _ = image_data(2)
    staged = assert_same_as_unsplit(net, (x,), {}, begin_specs(net))
    assert staged.training is False and staged.io[1].inputs == (("stage", 0, 0),)


def test_transformer_with_begin_block_on_layers_matches_unsplit():
    torch.manual_seed(0)
    model = TransformerClassifier(depth=4)
    for ipu in (1, 2, 3):  # like seed 003's BERT: BeginBlock(model.bert.encoder.layer[i], ...)
        model.layers[ipu] = poptorch.BeginBlock(model.layers[ipu], ipu_id=ipu)
    tokens, labels = token_data(3)
    staged = assert_same_as_unsplit(model, (tokens,), {"labels": labels}, begin_specs(model))
    assert_partition(staged, model, lambda n: int(n.split(".")[1]) if n.startswith("layers.")
                     else (3 if n.split(".")[0] in ("norm", "head") else 0))
    # The position table is read with get_attr: it is re-homed into stage 0, not passed in.
    assert "position" in dict(staged.modules[0].named_parameters())
    assert [io.inputs for io in staged.io][1:] == [(("stage", 0, 0),), (("stage", 1, 0),),
                                                   (("stage", 2, 0), ("input", 1))]
    inference = split_stages(model, (tokens,), {}, begin_specs(model))
    assert torch.equal(inference.run(tokens), model(tokens))


class SkipNet(nn.Module):
    """`h` from block A is read again in block C, skipping over block B's stage."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x, labels):
        with poptorch.Block("A"):
            h = torch.relu(self.a(x))
        with poptorch.Block("B"):
            g = torch.tanh(self.b(h))
        with poptorch.Block("C"):
            out = self.c(g + h)
            loss = F.cross_entropy(out, labels)
        return out, loss


def test_value_skipping_a_stage_is_an_input_of_its_reader_with_its_true_source():
    torch.manual_seed(0)
    model = SkipNet()
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    staged = assert_same_as_unsplit(model, (x, y), {}, specs("A", "B", "C"))
    assert [io.inputs for io in staged.io] == [
        (("input", 0),), (("stage", 0, 0),), (("stage", 1, 0), ("stage", 0, 0), ("input", 1))]
    assert staged.readers(0, 0) == (1, 2) and staged.readers(1, 0) == (2,)
    assert_partition(staged, model, lambda n: "abc".index(n[0]))


def test_begin_block_on_a_leaf_module_starts_the_block():
    # fx does not run hooks of leaf modules such as nn.Linear: the tracer starts the block itself.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    poptorch.BeginBlock(model[2], "tail", ipu_id=1)
    staged = assert_same_as_unsplit(model, (torch.randn(2, 3),), {}, specs((), ("tail",)))
    assert stage_parameter_names(staged) == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(self.mid(self.embed(tokens)))


def test_a_weight_tied_across_devices_is_held_by_a_stage_of_each():
    # The embedding on ipu 0, the head reading its weight on ipu 1: both stages hold it.
    model = TiedNet()
    poptorch.BeginBlock(model.mid, "B2", ipu_id=1)
    staged = assert_same_as_unsplit(model, (torch.tensor([[1, 2]]),), {}, specs((), ("B2",)))
    assert staged.owners["embed.weight"] == (0, 1) and staged.owners["mid.weight"] == (1,)
    assert staged.tied() == {"embed.weight": (0, 1)}
    held = [p for m in staged.modules for p in m.parameters() if p is model.embed.weight]
    assert len(held) == 2


class SharedBuffer(nn.Module):
    """A buffer read on two devices: forward may change it, so it cannot be copied."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 3)
        self.register_buffer("shift", torch.ones(3))

    def forward(self, x):
        with poptorch.Block("A", ipu_id=0):
            x = self.first(x) + self.shift
        with poptorch.Block("B", ipu_id=1):
            return self.second(x) * self.shift


def test_a_buffer_used_on_two_devices_is_an_error_naming_both_stages_and_the_fix():
    model = SharedBuffer()
    with pytest.raises(CompileError, match="Buffer 'shift' is used by stage 0 .*ipu 0.* by stage "
                                           "1 .*ipu 1.*Put both uses on one device"):
        split_stages(model, (torch.randn(2, 3),), {}, specs("A", "B"))


def test_tied_weights_of_two_stages_on_one_device_are_one_tensor():
    # ipus 0, 1, 0: the embedding and the head tied to it both live in device 0's worker
    model = TiedNet()
    poptorch.BeginBlock(model.mid, "B2", ipu_id=1)
    poptorch.BeginBlock(model.out, "B3", ipu_id=0)
    stages = [StageSpec(0, 0, ()), StageSpec(1, 1, ("B2",)), StageSpec(2, 0, ("B3",))]
    staged = assert_same_as_unsplit(model, (torch.tensor([[1, 2]]),), {}, stages)
    shared = [p for m in staged.modules for p in m.parameters() if p is model.embed.weight]
    assert len(shared) == 2  # stage 0's and stage 2's: the same Parameter
    assert staged.owners["embed.weight"] == (2,) and staged.tied() == {}  # one device


def test_tied_weights_within_one_stage_are_fine():
    model = TiedNet()
    poptorch.BeginBlock(model.mid, "B2", ipu_id=0)
    staged = split_stages(model, (torch.tensor([[1, 2]]),), {}, [StageSpec(0, 0, ("B2",))])
    assert staged.owners["embed.weight"] == (0,)  # out.weight is the same tensor, in the same stage
    assert stage_parameter_names(staged) == [["embed.weight", "mid.weight", "mid.bias"]]


class DataDependent(nn.Module):
    def __init__(self, construct: str):
        super().__init__()
        self.fc, self.construct = nn.Linear(3, 3), construct

    def forward(self, x):
        with poptorch.Block("B1"):
            x = self.fc(x)
        with poptorch.Block("B2"):
            if self.construct == "loop":
                for _ in range(x.shape[0]):
                    x = x * 2
            elif self.construct == "number":
                x = x[:, :int(x.abs().sum())]
            elif x.sum() > 0:
                x = -x
        return x


@pytest.mark.parametrize("construct, line, what", [
    ("branch", "elif x.sum() > 0:", "control flow"),
    ("number", "x = x[:, :int(x.abs().sum())]", "Python number read from a tensor"),
])
def test_uncapturable_forward_names_its_line_and_the_fix(construct, line, what):
    with pytest.raises(CompileError) as info:
        split_stages(DataDependent(construct), (torch.randn(2, 3),), {}, specs("B1", "B2"))
    message = str(info.value)
    assert f"in forward: `{line}`" in message and "test_split.py" in message
    assert "torch.export" in message and what in message and "single stage" in message


def test_python_control_flow_on_shapes_is_captured():
    # torch.fx refused `for _ in range(x.shape[0])`; export runs it with the call's shapes.
    torch.manual_seed(0)
    assert_same_as_unsplit(DataDependent("loop"), (torch.randn(2, 3),), {}, specs("B1", "B2"))


def test_op_after_a_block_ended_is_an_error():
    class Outside(nn.Module):
        def forward(self, x):
            with poptorch.Block("B1"):
                x = x + 1
            return x * 2

    with pytest.raises(CompileError, match="No active Block: 'mul' at .*`return x \\* 2` runs "
                                           "after block 'B1' ended"):
        split_stages(Outside(), (torch.ones(2),), {}, specs("B1"))


def test_stage_reading_a_later_stage_is_an_error():
    class Reentered(nn.Module):
        def forward(self, x):
            with poptorch.Block("B1"):
                x = x + 1
            with poptorch.Block("B2"):
                x = x * 2
            with poptorch.Block("B1"):
                return x - 3

    with pytest.raises(CompileError, match="'sub' in block 'B1' \\(stage 0\\) reads 'mul', "
                                           "computed later in block 'B2' \\(stage 1\\)"):
        split_stages(Reentered(), (torch.ones(2),), {}, specs("B1", "B2"))


def test_stages_naming_other_blocks_than_forward_enters_is_an_error():
    with pytest.raises(CompileError, match="entered blocks \\['A', 'B', 'C'\\] but the stages are "
                                           "made of blocks \\['A', 'B'\\]"):
        split_stages(SkipNet(), (torch.ones(1, 4), torch.tensor([0])), {}, specs("A", "B"))


def test_model_without_blocks_is_one_stage():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    staged = assert_same_as_unsplit(model, (torch.randn(2, 3),), {}, [StageSpec(0, 0, ())])
    assert len(staged.modules) == 1 and staged.io[0].inputs == (("input", 0),)


def test_block_without_ops_is_an_empty_stage():
    class Gap(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            with poptorch.Block("A"):
                x = self.a(x)
            with poptorch.Block("empty"):
                pass
            with poptorch.Block("B"):
                return self.b(x)

    torch.manual_seed(0)
    staged = assert_same_as_unsplit(Gap(), (torch.randn(3, 2),), {}, specs("A", "empty", "B"))
    assert staged.io[1].inputs == () and staged.modules[1]() == ()
    assert staged.io[2].inputs == (("stage", 0, 0),)
