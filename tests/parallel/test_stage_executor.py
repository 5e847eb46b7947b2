"""StageExecutor run in this process: same numbers as a plain PyTorch loop, for one or more stages.

One stage runs over a real single-process gloo group and PeerLink. Several devices run in
threads of this process over `QueueLink`, PeerLink's interface backed by queues (a process
group cannot hold two ranks of one process); the bundles still go through BundleLayout. A
device holding several stages hands its own stages' bundles over in memory.
"""
import copy
import operator
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import pipetorch as poptorch
from helpers.models import TinyMLP
from helpers.reference import plain_train_call
from pipetorch.errors import DeviceError
from helpers.reference import last_output
from pipetorch.parallel.layout.routes import routes_of, value_specs
import pipetorch.parallel.worker.stage as stage_module
from pipetorch.parallel.worker.split_backward import backward_weight
from pipetorch.parallel.comm.payloads import Call, DeviceStage
from pipetorch.parallel.worker.stage import StageExecutor
from pipetorch.partition.inplace import inplace_inputs
from pipetorch.parallel.comm.transport import PeerLink, Tag
from pipetorch.partition.split import split_stages
from pipetorch.partition.strategies import StageSpec
from pipetorch.partition.trace import trace_blocks
from pipetorch.schedule.device_plans import merge, stages_of
from pipetorch.schedule.plans import plan

CPU = torch.device("cpu")


# -- inplace_inputs -----------------------------------------------------------------------------
class Mutating(nn.Module):
    def __init__(self):
        super().__init__()
        self.relu, self.fc = nn.ReLU(inplace=True), nn.Linear(2, 2)

    def forward(self, a, b, c, d, e, f):
        self.relu(a)                   # module with inplace=True on input 0
        b.add_(1)                      # method ending in "_" on input 1
        F.relu(c, inplace=True)        # functional with inplace=True on input 2
        y = self.fc(d) + e             # d and e only read
        self.relu(y)                   # in place, but on a computed value
        y.mul_(2)
        y.add_(f)                      # f is an operand, not the tensor modified
        return a, b, c, y


def test_inplace_inputs_finds_the_modified_placeholders_only():
    assert inplace_inputs(fx.symbolic_trace(Mutating())) == {0, 1, 2}


def test_inplace_inputs_sees_operator_iadd_and_ignores_out_of_place_ops():
    graph = fx.Graph()
    x, y, z = graph.placeholder("x"), graph.placeholder("y"), graph.placeholder("z")
    total = graph.call_function(operator.add, (y, z))
    graph.call_function(operator.iadd, (z, 1))       # z += 1 on the tensor itself
    graph.call_function(operator.imul, (total, x))   # in place on a computed value
    graph.call_method("relu", (x,))                  # out of place
    graph.output((x, total))
    assert inplace_inputs(fx.GraphModule(nn.Module(), graph)) == {2}


def test_inplace_inputs_of_a_plain_module_or_non_inplace_relu_is_empty():
    assert inplace_inputs(nn.ReLU(inplace=True)) == set()  # not a GraphModule: nothing to read
    assert inplace_inputs(fx.symbolic_trace(nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))) == set()


def test_inplace_inputs_finds_inplace_passed_positionally():
    # F.relu(x, True) and F.leaky_relu(x, 0.1, True) modify x exactly like inplace=True
    class Positional(nn.Module):
        def forward(self, a, b):
            return F.relu(a, True), F.leaky_relu(b, 0.1, True)

    assert inplace_inputs(fx.symbolic_trace(Positional())) == {0, 1}


# -- one stage over a real gloo process group ---------------------------------------------------
@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def one_stage(model, sample, optimizer_of=None, traced=None):
    staged = split_stages(model, sample, {}, [StageSpec(0, 0, ())], traced=traced)
    (route,) = routes_of(staged, loss_index=last_output(staged) if model.training else None)
    specs = value_specs(staged, sample, {}, training=model.training)
    module = staged.modules[0]
    optimizer = optimizer_of(module.parameters()) if optimizer_of else None
    link = PeerLink(device=CPU, wire_device=CPU, timeout=10)
    executor = StageExecutor([DeviceStage(module, route, staged.io[0].inputs)], specs, link=link,
                             device=CPU, optimizer=optimizer)
    return staged, executor


def stacked(x, micro_batches):
    """[N*B, ...] -> [N, B, ...]: one row per micro-batch, as the host sends them."""
    return x.reshape(micro_batches, -1, *x.shape[1:])


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def mlp_data(count, batch=2):
    torch.manual_seed(1)
    return torch.randn(count * batch, 6), torch.randint(0, 3, (count * batch,))


def check_spans(spans, expected_kinds):
    assert [(s.kind, s.micro_batch) for s in spans] == expected_kinds
    for before, after in zip(spans, spans[1:]):
        assert before.start <= before.end <= after.start
    assert all(s.nbytes == 0 for s in spans)


@pytest.mark.parametrize("D, G", [(3, 4), (1, 1), (2, 3)])
def test_one_training_stage_matches_a_plain_pytorch_loop(gloo, D, G):
    torch.manual_seed(0)
    model = TinyMLP()
    reference = copy.deepcopy(model)
    x, y = mlp_data(D * G)
    staged, executor = one_stage(model, (x[:2], y[:2]), sgd)
    call = Call(inputs={0: stacked(x, D * G), 1: stacked(y, D * G)}, iterations=D,
                micro_batches=G, wanted=frozenset(range(D * G)), scale=1 / G)
    executor.run(plan("pipelined", 1, G, training=True)[0], call, training=True)

    expected = plain_train_call(reference, sgd(reference.parameters()), x, y, D=D, G=G, R=1)
    assert sorted(executor.outputs[0]) == list(range(D * G))
    for m, (_, _, out, loss) in enumerate(expected):
        got_out, got_loss = executor.outputs[0][m]
        assert torch.allclose(got_out, out, rtol=0, atol=1e-6), m
        assert torch.allclose(got_loss, loss, rtol=0, atol=1e-6), m
        assert not got_out.requires_grad and got_out.is_contiguous()
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(p, ref, rtol=0, atol=1e-6), name
    assert dict(staged.modules[0].named_parameters())["fc1.weight"] is model.fc1.weight

    # 1F1B on one stage: F then B of each micro-batch, one STEP per device iteration
    check_spans(executor.traces[0].spans,
                [span for d in range(D) for span in
                 [(k, d * G + g) for g in range(G) for k in ("F", "B")] + [("STEP", None)]])
    assert [t.stage for t in executor.traces] == [0]


def test_wanted_filters_the_outputs_and_a_second_run_starts_afresh(gloo):
    torch.manual_seed(0)
    model = TinyMLP()
    x, y = mlp_data(6)
    _, executor = one_stage(model, (x[:2], y[:2]), sgd)
    actions = plan("pipelined", 1, 3, training=True)[0]
    call = Call({0: stacked(x, 6), 1: stacked(y, 6)}, 2, 3, frozenset({1, 5}), 1 / 3)
    executor.run(actions, call, training=True)
    assert sorted(executor.outputs[0]) == [1, 5]
    assert len(executor.traces[0].spans) == 2 * (3 * 2 + 1)
    executor.run(actions, Call(call.inputs, 2, 3, frozenset(), 1 / 3), training=True)
    assert executor.outputs == {0: {}} and len(executor.traces[0].spans) == 14


def test_one_inference_stage_runs_forwards_only(gloo):
    torch.manual_seed(0)
    model = TinyMLP()
    x, y = mlp_data(4)
    before = copy.deepcopy(model.state_dict())
    model.eval()
    _, executor = one_stage(model, (x[:2], y[:2]))
    executor.run(plan("pipelined", 1, 4, training=False)[0],
                 Call({0: stacked(x, 4), 1: stacked(y, 4)}, 1, 4, frozenset(range(4))),
                 training=False)
    for m in range(4):
        out, loss = model(x[2 * m:2 * m + 2], y[2 * m:2 * m + 2])
        assert torch.equal(executor.outputs[0][m][0], out.detach())
        assert torch.equal(executor.outputs[0][m][1], loss.detach())
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    check_spans(executor.traces[0].spans, [("F", m) for m in range(4)])


def test_a_non_tensor_output_that_changes_is_a_device_error(gloo):
    class Sized(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(x).sum(), x.size(0)

    # torch.fx, the fallback capture, keeps x.size(0) a value computed per call (torch.export
    # bakes the first call's 4 into the graph, and the host refuses other batch sizes)
    model = Sized().eval()
    _, executor = one_stage(model, (torch.ones(4, 3),),
                            traced=trace_blocks(model, (torch.ones(4, 3),), {}))
    with pytest.raises(DeviceError, match="Stage 0 output 1 was 4 when the model was compiled "
                                          "and is 2 for this micro-batch"):
        executor.run(plan("pipelined", 1, 1, training=False)[0],
                     Call({0: torch.ones(1, 2, 3)}, 1, 1, frozenset({0})), training=False)


# -- several stages in threads -------------------------------------------------------------------
class QueueLink:
    """PeerLink's interface over in-process queues: asynchronous sends, blocking receives."""

    kind = "queue"  # what the trace names as the transport

    def __init__(self, rank, boxes, lock):
        self.rank, self._boxes, self._lock = rank, boxes, lock
        self.bytes_sent = self.bytes_received = 0

    def _box(self, src, dst, tag):
        with self._lock:
            return self._boxes.setdefault((src, dst, int(tag)), queue.Queue())

    def send(self, layout, tensors, peer, tag):
        if layout.specs:
            buffer = layout.pack(tensors, CPU)
            self._box(self.rank, peer, tag).put(buffer)
            self.bytes_sent += buffer.numel()

    def recv(self, layout, peer, tag):
        if not layout.specs:
            return []
        buffer = self._box(peer, self.rank, tag).get(timeout=10)
        self.bytes_received += buffer.numel()
        return layout.unpack(buffer)

    def signal(self, peer, tag):
        self._box(self.rank, peer, tag).put(None)

    def wait_signal(self, peer, tag):
        self._box(peer, self.rank, tag).get(timeout=10)

    def flush(self):
        pass


def run_stages(staged, sample, call, *, training, schedule, optimizer_of=None, owners=None):
    """Every device's executor in its own thread, like the workers; returns the executors.

    `owners[s]` is stage s's device (default: a device per stage); a device runs its list of
    the merged schedule over its stages, with one optimiser over all of their parameters.
    """
    routes = routes_of(staged, loss_index=last_output(staged) if training else None)
    specs = value_specs(staged, sample, {}, training=training)
    boxes, lock = {}, threading.Lock()
    owners = tuple(range(len(routes))) if owners is None else owners
    plans = merge(plan(schedule, len(routes), call.micro_batches, training=training), owners)
    executors = []
    for d in range(len(plans)):
        stages = [DeviceStage(staged.modules[s], routes[s], staged.io[s].inputs)
                  for s in stages_of(owners, d)]
        params = [p for stage in stages for p in stage.module.parameters()]
        optimizer = optimizer_of(params) if optimizer_of and training else None
        executors.append(StageExecutor(stages, specs, link=QueueLink(d, boxes, lock), device=CPU,
                                       optimizer=optimizer, owners=owners))
    with ThreadPoolExecutor(len(plans)) as pool:
        futures = []
        for d, e in enumerate(executors):
            reads = {i for h in e.held.values() for i in h.route.host_inputs}
            futures.append(pool.submit(
                e.run, plans[d], Call({i: call.inputs[i] for i in reads}, call.iterations,
                                      call.micro_batches, call.wanted, call.scale),
                training=training))
        for future in futures:
            future.result(timeout=30)
    return executors


def outputs_of(executors):
    """Stage -> micro-batch -> host outputs, over every device."""
    return {s: o for e in executors for s, o in e.outputs.items()}


class SkipNet(nn.Module):
    """h (block A) is read by B and, over B's stage, by C; A also hands B a size."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x, labels):
        with poptorch.Block("A"):
            h = torch.relu(self.a(x))
            rows = x.size(0)
        with poptorch.Block("B"):
            g = torch.tanh(self.b(h)).reshape(rows, -1)
        with poptorch.Block("C"):
            out = self.c(g + h)
            loss = F.cross_entropy(out, labels)
        return out, loss


def three_stages():
    return [StageSpec(i, i, (b,)) for i, b in enumerate("ABC")]


@pytest.mark.parametrize("schedule", ["pipelined", "zero_bubble", "fill_drain", "sharded"])
def test_three_stages_with_a_relayed_skip_connection_match_plain_pytorch(schedule, monkeypatch):
    D, G, B = 2, 4, 3
    split = []  # per W: whether its B left the weights' gradients to it
    monkeypatch.setattr(stage_module, "backward_weight",
                        lambda deferred: (split.append(deferred is not None),
                                          backward_weight(deferred)))
    torch.manual_seed(0)
    model = SkipNet()
    reference = copy.deepcopy(model)
    x, y = torch.randn(D * G * B, 4), torch.randint(0, 3, (D * G * B,))
    sample = (x[:B], y[:B])
    staged = split_stages(model, sample, {}, three_stages())
    call = Call({0: stacked(x, D * G), 1: stacked(y, D * G)}, D, G, frozenset(range(D * G)),
                1 / G)
    executors = run_stages(staged, sample, call, training=True, schedule=schedule,
                           optimizer_of=sgd)

    expected = plain_train_call(reference, sgd(reference.parameters()), x, y, D=D, G=G, R=1)
    last = outputs_of(executors)[2]
    for m, (_, _, out, loss) in enumerate(expected):
        assert torch.allclose(last[m][0], out, rtol=0, atol=1e-6), m
        assert torch.allclose(last[m][1], loss, rtol=0, atol=1e-6), m
    assert outputs_of(executors)[0] == {m: [] for m in range(D * G)}
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(p, ref, rtol=0, atol=1e-6), name
    # Per micro-batch, each bundle entry is B x 6 float32 = 72 bytes, padded to 80. Stage 0
    # sends h (rows is a Constant: not sent); stage 1 sends h (relayed) and g on, and h's
    # gradient back; stage 2 sends the gradients of h and g back.
    entry = _aligned(B * 6 * 4)
    assert entry == 80
    assert [e.link.bytes_sent for e in executors] == [D * G * n * entry for n in (1, 3, 2)]
    assert [e.link.bytes_received for e in executors] == [D * G * n * entry for n in (1, 3, 2)]
    for e in executors:
        kinds = [s.kind for s in e.traces[0].spans]
        assert kinds.count("F") == kinds.count("B") == D * G and kinds.count("STEP") == D
        assert kinds.count("W") == (D * G if schedule == "zero_bubble" else 0)
    # stages 1 and 2 split every backward; stage 0 has no input gradient to send first
    assert sorted(split) == ([False] * D * G + [True] * 2 * D * G
                             if schedule == "zero_bubble" else [])


def _aligned(size):
    return (size + 15) // 16 * 16


@pytest.mark.parametrize("schedule", ["pipelined", "sharded"])
def test_three_stage_inference_matches_the_model(schedule):
    torch.manual_seed(0)
    model = SkipNet().eval()
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    staged = split_stages(model, (x[:2], y[:2]), {}, three_stages())
    call = Call({0: stacked(x, 5), 1: stacked(y, 5)}, 1, 5, frozenset({0, 3}))
    executors = run_stages(staged, (x[:2], y[:2]), call, training=False, schedule=schedule)
    assert sorted(outputs_of(executors)[2]) == [0, 3]
    with torch.no_grad():
        for m in (0, 3):
            out, loss = model(x[2 * m:2 * m + 2], y[2 * m:2 * m + 2])
            assert torch.equal(outputs_of(executors)[2][m][0], out)
            assert torch.equal(outputs_of(executors)[2][m][1], loss)


# Bundle entries each device sends per micro-batch (see the test above): ipus 0, 1, 0 cross
# devices at both boundaries; 0, 0, 1 hands stage 0's bundle to stage 1 in memory.
SENT_BY_DEVICE = {(0, 1, 0): [3, 3], (0, 0, 1): [2, 2], (0, 0, 0): [0]}


@pytest.mark.parametrize("owners", list(SENT_BY_DEVICE))
@pytest.mark.parametrize("schedule", ["pipelined", "zero_bubble", "sharded"])
def test_devices_holding_several_stages_match_plain_pytorch(owners, schedule):
    D, G, B = 2, 5, 3
    torch.manual_seed(0)
    model = SkipNet()
    reference = copy.deepcopy(model)
    x, y = torch.randn(D * G * B, 4), torch.randint(0, 3, (D * G * B,))
    staged = split_stages(model, (x[:B], y[:B]), {}, three_stages())
    call = Call({0: stacked(x, D * G), 1: stacked(y, D * G)}, D, G, frozenset(range(D * G)),
                1 / G)
    executors = run_stages(staged, (x[:B], y[:B]), call, training=True, schedule=schedule,
                           optimizer_of=sgd, owners=owners)

    expected = plain_train_call(reference, sgd(reference.parameters()), x, y, D=D, G=G, R=1)
    for m, (_, _, out, loss) in enumerate(expected):
        assert torch.allclose(outputs_of(executors)[2][m][0], out, rtol=0, atol=1e-6), m
        assert torch.allclose(outputs_of(executors)[2][m][1], loss, rtol=0, atol=1e-6), m
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(p, ref, rtol=0, atol=1e-6), name
    entry = _aligned(B * 6 * 4)
    assert [e.link.bytes_sent for e in executors] == [
        D * G * n * entry for n in SENT_BY_DEVICE[owners]]
    for e in executors:  # every stage keeps its own spans; one STEP per device and iteration
        for n, trace in enumerate(e.traces):
            kinds = [s.kind for s in trace.spans]
            assert kinds.count("F") == kinds.count("B") == D * G, trace.stage
            assert kinds.count("STEP") == (D if n == 0 else 0)


def test_a_device_holding_stages_zero_and_two_infers_like_the_model():
    torch.manual_seed(0)
    model = SkipNet().eval()
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    staged = split_stages(model, (x[:2], y[:2]), {}, three_stages())
    call = Call({0: stacked(x, 5), 1: stacked(y, 5)}, 1, 5, frozenset(range(5)))
    for schedule in ("pipelined", "sharded"):
        executors = run_stages(staged, (x[:2], y[:2]), call, training=False, schedule=schedule,
                               owners=(0, 1, 0))
        with torch.no_grad():
            for m in range(5):
                out, loss = model(x[2 * m:2 * m + 2], y[2 * m:2 * m + 2])
                assert torch.equal(outputs_of(executors)[2][m][0], out)
                assert torch.equal(outputs_of(executors)[2][m][1], loss)


class InplaceOnReceived(nn.Module):
    """Stage B applies an in-place ReLU to the activation it receives from A."""

    def __init__(self, positional):
        super().__init__()
        self.a, self.b, self.positional = nn.Linear(4, 5), nn.Linear(5, 3), positional

    def forward(self, x, labels):
        with poptorch.Block("A"):
            h = self.a(x)
        with poptorch.Block("B"):
            h = F.relu(h, True) if self.positional else F.relu(h, inplace=True)
            out = self.b(h)
            loss = F.cross_entropy(out, labels)
        return out, loss


@pytest.mark.parametrize("schedule", ["pipelined", "zero_bubble"])
@pytest.mark.parametrize("positional", [False, True])
def test_inplace_op_on_a_received_activation_matches_plain_pytorch(positional, schedule):
    G, B = 2, 3
    torch.manual_seed(0)
    model = InplaceOnReceived(positional)
    reference = copy.deepcopy(model)
    x, y = torch.randn(G * B, 4), torch.randint(0, 3, (G * B,))
    staged = split_stages(model, (x[:B], y[:B]), {},
                          [StageSpec(0, 0, ("A",)), StageSpec(1, 1, ("B",))])
    call = Call({0: stacked(x, G), 1: stacked(y, G)}, 1, G, frozenset(range(G)), 1 / G)
    executors = run_stages(staged, (x[:B], y[:B]), call, training=True, schedule=schedule,
                           optimizer_of=sgd)
    expected = plain_train_call(reference, sgd(reference.parameters()), x, y, D=1, G=G, R=1)
    for m, (_, _, out, loss) in enumerate(expected):
        assert torch.allclose(outputs_of(executors)[1][m][0], out, rtol=0, atol=1e-6)
        assert torch.allclose(outputs_of(executors)[1][m][1], loss, rtol=0, atol=1e-6)
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(p, ref, rtol=0, atol=1e-6), name


class LossOnly(nn.Module):
    """forward returns the loss alone (no tuple), as many PopTorch models do."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x, labels):
        with poptorch.Block("A"):
            h = torch.tanh(self.a(x))
        with poptorch.Block("B"):
            return F.cross_entropy(self.b(h), labels)


def test_forward_returning_only_the_loss_trains_every_stage():
    G, B = 2, 3
    torch.manual_seed(0)
    model = LossOnly()
    reference = copy.deepcopy(model)
    x, y = torch.randn(G * B, 4), torch.randint(0, 3, (G * B,))
    staged = split_stages(model, (x[:B], y[:B]), {},
                          [StageSpec(0, 0, ("A",)), StageSpec(1, 1, ("B",))])
    call = Call({0: stacked(x, G), 1: stacked(y, G)}, 1, G, frozenset(range(G)), 1 / G)
    executors = run_stages(staged, (x[:B], y[:B]), call, training=True, schedule="pipelined",
                           optimizer_of=sgd)

    def loss_twice(*args):  # plain_train_call wants (output, loss)
        loss = reference(*args)
        return loss, loss

    expected = plain_train_call(loss_twice, sgd(reference.parameters()), x, y, D=1, G=G, R=1)
    for m, (_, _, _, loss) in enumerate(expected):
        assert torch.allclose(outputs_of(executors)[1][m][0], loss, rtol=0, atol=1e-6)
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(p, ref, rtol=0, atol=1e-6), name


class TwoHeads(nn.Module):
    """Stage B reads only the host input: stage A sends it nothing."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 3)

    def forward(self, x):
        with poptorch.Block("A"):
            first = self.a(x)
        with poptorch.Block("B"):
            second = self.b(x)
        return first, second


@pytest.mark.parametrize("training", [False, True])
def test_stage_sending_nothing_to_the_next_one(training):
    torch.manual_seed(0)
    model = TwoHeads().train(training)
    x = torch.randn(6, 4)
    staged = split_stages(model, (x[:2],), {}, [StageSpec(0, 0, ("A",)), StageSpec(1, 1, ("B",))])
    assert routes_of(staged, loss_index=last_output(staged) if training else None)[0].send == ()
    with torch.no_grad():  # before the run: in training, `second` is the loss and b steps
        expected = [(model.a(x[2 * m:2 * m + 2]), model.b(x[2 * m:2 * m + 2])) for m in range(3)]
    call = Call({0: stacked(x, 3)}, 1, 3, frozenset(range(3)), 1.0)
    executors = run_stages(staged, (x[:2],), call, training=training, schedule="pipelined",
                           optimizer_of=sgd)
    for m, (first, second) in enumerate(expected):
        assert torch.equal(outputs_of(executors)[0][m][0], first)
        assert torch.equal(outputs_of(executors)[1][m][0], second)
