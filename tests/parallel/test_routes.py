"""routes_of and value_specs: which values each stage takes from and gives to whom, and their specs."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pipetorch as poptorch
from helpers.models import TinyMLP
from helpers.reference import last_output
from pipetorch.parallel.layout.routes import Constant, Route, TensorSpec, routes_of, value_specs
from pipetorch.partition.split import Source, split_stages
from pipetorch.partition.strategies import StageSpec
from pipetorch.partition.trace import trace_blocks


def stages(*blocks):
    """One stage per block id, stage i on device i."""
    return [StageSpec(i, i, (b,)) for i, b in enumerate(blocks)]


def stage(j, k):
    return Source.stage(j, k)


class SkipNet(nn.Module):
    """`h` (block A) is read by B and again by C, over B's stage; A also hands B a size."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x, labels=None):
        with poptorch.Block("A"):
            h = torch.relu(self.a(x))
            rows = x.size(0)
        with poptorch.Block("B"):
            g = torch.tanh(self.b(h)).reshape(rows, -1)
        with poptorch.Block("C"):
            out = self.c(g + h)
            if labels is None:
                return out
            loss = F.cross_entropy(out, labels)
        return out, loss


def skip_data():
    torch.manual_seed(0)
    return torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])


@pytest.fixture(scope="module")
def skip_training():
    x, y = skip_data()
    return split_stages(SkipNet(), (x, y), {}, stages("A", "B", "C")), (x, y)


@pytest.fixture(scope="module")
def skip_training_fx():
    """The skip net captured by torch.fx, the fallback capture, where sizes stay values."""
    x, y = skip_data()
    model = SkipNet()
    staged = split_stages(model, (x, y), {}, stages("A", "B", "C"),
                          traced=trace_blocks(model, (x, y), {}))
    return staged, (x, y)


def test_skip_connection_is_relayed_through_the_middle_stage(skip_training):
    staged, _ = skip_training
    h, g, out, loss = stage(0, 0), stage(1, 0), stage(2, 0), stage(2, 1)
    assert routes_of(staged, loss_index=last_output(staged)) == [
        # torch.export captures the first call's shapes: `rows` is the number 5 inside
        # stage 1's graph, so only h crosses from stage 0
        Route(index=0, stages=3, host_inputs=(0,), receive=(), send=(h,),
              host_outputs=(), loss=None),
        # h is produced on 0 and read on 2: it rides in stage 1's receive AND send
        Route(index=1, stages=3, host_inputs=(), receive=(h,), send=(h, g),
              host_outputs=(), loss=None),
        # the labels are read only by the last stage, straight from the host
        Route(index=2, stages=3, host_inputs=(1,), receive=(h, g), send=(),
              host_outputs=(out, loss), loss=loss),
    ]


def test_routes_of_a_training_graph_for_inference_locate_no_loss(skip_training):
    staged, _ = skip_training
    routes = routes_of(staged)
    assert [r.loss for r in routes] == [None, None, None]
    assert routes[2].host_outputs == (stage(2, 0), stage(2, 1))
    assert [(r.index == 0, r.is_last) for r in routes] == [(True, False), (False, False),
                                                         (False, True)]


def test_inference_graph_without_labels_reads_one_host_input():
    x, _ = skip_data()
    model = SkipNet().eval()
    staged = split_stages(model, (x,), {}, stages("A", "B", "C"))
    routes = routes_of(staged)
    assert [r.host_inputs for r in routes] == [(0,), (), ()]
    assert routes[2].host_outputs == (stage(2, 0),) and routes[2].loss is None
    assert routes[1].send == (stage(0, 0), stage(1, 0))
    specs = value_specs(staged, (x,), {}, training=False)
    assert not any(s.requires_grad for s in specs.values() if isinstance(s, TensorSpec))


def test_fx_capture_sends_a_size_as_a_value(skip_training_fx):
    staged, _ = skip_training_fx
    h, rows = stage(0, 0), stage(0, 1)
    routes = routes_of(staged, loss_index=last_output(staged))
    assert routes[0].send == (h, rows) and routes[1].receive == (h, rows)


def test_value_specs_of_the_skip_net(skip_training_fx):
    staged, (x, y) = skip_training_fx
    specs = value_specs(staged, (x, y), {}, training=True)
    assert specs == {
        stage(0, 0): TensorSpec((5, 6), torch.float32, True),
        stage(0, 1): Constant(5),  # x.size(0) crosses from stage 0 to 1 as a Constant
        stage(1, 0): TensorSpec((5, 6), torch.float32, True),
        stage(2, 0): TensorSpec((5, 3), torch.float32, True),
        stage(2, 1): TensorSpec((), torch.float32, True),
    }
    assert specs[stage(0, 0)].nbytes == 5 * 6 * 4 and specs[stage(2, 1)].nbytes == 4
    inference = value_specs(staged, (x, y), {}, training=False)
    assert inference[stage(0, 0)] == TensorSpec((5, 6), torch.float32, False)
    assert inference[stage(0, 1)] == Constant(5)


class MixedNet(nn.Module):
    """Stage A hands B a float that needs a gradient, one that does not, and int64 indices;
    it also returns a value of its own to the host, and forward reads three inputs."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(10, 4), nn.Linear(4, 3)

    def forward(self, tokens, x, labels):
        with poptorch.Block("A"):
            idx = (tokens + 1) % 10
            scaled = x * 2               # no parameter involved: no gradient to send back
            feats = self.emb(idx).sum(1)
            mid = feats.mean()           # a host output computed on the first stage
        with poptorch.Block("B"):
            out = self.fc(feats + scaled) + idx.float().mean()
            loss = F.cross_entropy(out, labels)
        return mid, out, loss


def test_mixed_values_specs_and_host_outputs_per_stage():
    torch.manual_seed(0)
    tokens, x = torch.randint(0, 10, (5, 2)), torch.randn(5, 4)
    labels = torch.tensor([0, 1, 2, 0, 1])
    staged = split_stages(MixedNet(), (tokens, x, labels), {}, stages("A", "B"))
    first, last = routes_of(staged, loss_index=last_output(staged))
    assert first.host_inputs == (0, 1) and last.host_inputs == (2,)
    assert first.send == last.receive == (stage(0, 0), stage(0, 1), stage(0, 2))
    assert first.host_outputs == (stage(0, 3),) and first.loss is None
    assert last.host_outputs == (stage(1, 0), stage(1, 1)) and last.loss == stage(1, 1)
    specs = value_specs(staged, (tokens, x, labels), {}, training=True)
    assert specs[stage(0, 0)] == TensorSpec((5, 4), torch.float32, True)
    assert specs[stage(0, 1)] == TensorSpec((5, 4), torch.float32, False)
    assert specs[stage(0, 2)] == TensorSpec((5, 2), torch.int64, False)
    assert specs[stage(0, 3)] == TensorSpec((), torch.float32, True)
    assert specs[stage(0, 2)].nbytes == 5 * 2 * 8


class LossInTheMiddle(nn.Module):
    """The loss is made on stage 1 of 3 and forward returns it last."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(4, 5)

    def forward(self, x, labels):
        with poptorch.Block("A"):
            h = self.a(x)
        with poptorch.Block("B"):
            loss = F.cross_entropy(self.b(h), labels)
            h2 = torch.relu(h)
        with poptorch.Block("C"):
            out = self.c(h2)
        return out, loss


def test_loss_is_located_on_the_stage_computing_it():
    torch.manual_seed(0)
    x, y = torch.randn(2, 3), torch.tensor([0, 1])
    staged = split_stages(LossInTheMiddle(), (x, y), {}, stages("A", "B", "C"))
    routes = routes_of(staged, loss_index=last_output(staged))
    (loss,) = [s for s in routes[1].host_outputs if staged.output[-1] == s]
    assert [r.loss for r in routes] == [None, loss, None]
    assert routes[2].host_outputs == (staged.output[0],)
    assert [r.host_inputs for r in routes] == [(0,), (1,), ()]
    assert routes[1].send == routes[2].receive and len(routes[1].send) == 1


def test_a_single_stage_sends_and_receives_nothing():
    torch.manual_seed(0)
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 0])
    staged = split_stages(TinyMLP(), (x, y), {}, [StageSpec(0, 0, ())])
    (route,) = routes_of(staged, loss_index=last_output(staged))
    assert route == Route(index=0, stages=1, host_inputs=(0, 1), receive=(), send=(),
                          host_outputs=(stage(0, 0), stage(0, 1)), loss=stage(0, 1))
    assert route.index == 0 and route.is_last
    specs = value_specs(staged, (x, y), {}, training=True)
    assert specs == {stage(0, 0): TensorSpec((4, 3), torch.float32, True),
                     stage(0, 1): TensorSpec((), torch.float32, True)}


def test_loss_only_output_and_an_output_returned_twice():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            with poptorch.Block("A"):
                y = self.fc(x)
            with poptorch.Block("B"):
                s = y.sum()
            return {"a": s, "b": [s]}, s

    staged = split_stages(Twice(), (torch.ones(1, 2),), {}, stages("A", "B"))
    routes = routes_of(staged, loss_index=last_output(staged))
    assert routes[1].host_outputs == (stage(1, 0),)  # listed once however often forward returns it
    assert routes[1].loss == stage(1, 0) and routes[0].host_outputs == ()


def test_forward_returning_only_the_loss_locates_it():
    class LossOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

        def forward(self, x, labels):
            with poptorch.Block("A"):
                h = self.a(x)
            with poptorch.Block("B"):
                return F.cross_entropy(self.b(h), labels)

    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    staged = split_stages(LossOnly(), (x, y), {}, stages("A", "B"))
    assert staged.output == stage(1, 0)  # a bare Source, itself a tuple ("stage", 1, 0)
    routes = routes_of(staged, loss_index=last_output(staged))
    assert routes[1].host_outputs == (stage(1, 0),)
    assert [r.loss for r in routes] == [None, stage(1, 0)]


class NormDropNet(nn.Module):
    """BatchNorm's running statistics, dropout's RNG and a detached branch in stage A."""

    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)

    def forward(self, x):
        with poptorch.Block("A"):
            h = F.dropout(self.bn(self.a(x)), 0.5)
            frozen = h.detach() * 2
        with poptorch.Block("B"):
            return poptorch.identity_loss(self.b(h + frozen).sum(), "sum")


def test_value_specs_run_no_forward_and_equal_a_real_run():
    from pipetorch.parallel.layout import routes

    torch.manual_seed(0)
    model, x = NormDropNet().train(), torch.randn(5, 4)
    staged = split_stages(model, (x,), {}, stages("A", "B"))
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.random.get_rng_state()
    ran = []
    staged.modules[0].register_forward_pre_hook(
        lambda module, inputs: ran.append(isinstance(inputs[0], torch._subclasses.FakeTensor)))
    specs = value_specs(staged, (x,), {}, training=True)
    assert ran == [True]  # the stage ran once, on fake tensors
    assert torch.equal(torch.random.get_rng_state(), rng)  # no dropout mask was drawn
    for name, b in model.named_buffers():  # no running statistic moved
        assert torch.equal(b, buffers[name]), name
    assert specs[stage(0, 0)] == TensorSpec((5, 6), torch.float32, True)
    assert specs[stage(0, 1)] == TensorSpec((5, 6), torch.float32, False)  # detached
    real = routes._specs(staged, (x,), {}, training=True, mode=None)
    assert specs == real
