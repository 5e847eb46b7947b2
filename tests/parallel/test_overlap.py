"""Replicas' all-reduce started early: buckets start inside the step's last backward, in one
fixed order, and the weights end exactly as when every bucket is summed at the step."""
import copy
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import pipetorch as poptorch
from helpers.reference import last_output
from pipetorch.parallel.worker.overlap import arming
from pipetorch.parallel.worker.recompute import stage_module
from pipetorch.parallel.layout.routes import routes_of, value_specs
from pipetorch.parallel.comm.payloads import Call, DeviceStage
from pipetorch.parallel.worker.stage import StageExecutor
from pipetorch.parallel.comm.transport import PeerLink
from pipetorch.partition.split import split_stages
from pipetorch.partition.strategies import StageSpec
from pipetorch.schedule.actions import Action, Kind
from pipetorch.schedule.device_plans import merge
from pipetorch.schedule.plans import plan

CPU = torch.device("cpu")
D, G, B = 2, 4, 3


class Wide(nn.Module):
    """Three blocks whose weights fill many 400-byte buckets; `share` makes block C reuse
    block B's weight (a weight two stages of one device share)."""

    def __init__(self, share=False):
        super().__init__()
        self.share = share
        self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.head = nn.Linear(32, 3)

    def forward(self, x, labels):
        with poptorch.Block("A"):
            h = torch.tanh(self.a(x))
        with poptorch.Block("B"):
            h = torch.tanh(self.b(h))
        with poptorch.Block("C"):
            weight = self.b.weight if self.share else self.c.weight
            out = self.head(torch.tanh(F.linear(h, weight, self.c.bias)))
            loss = F.cross_entropy(out, labels)
        return out, loss


class Doubling:
    """dist.all_reduce as two identical replicas would sum (x + x, at once), noting what the
    executor was running when each bucket started and how many of that stage's spans had
    ended."""

    def __init__(self):
        self.executor, self.calls = None, []

    def __call__(self, flat, group=None, async_op=False):
        action, _ = self.executor.current
        spans = len(self.executor.held[action.stage].trace.spans)
        self.calls.append((action, spans, flat.numel()))
        flat.add_(flat.clone())
        return mock.Mock(wait=mock.Mock(return_value=True))


def with_all_reduce(actions):
    """The device's list as a replicated worker runs it (worker.Worker._plan): AR before STEP."""
    at = next(n for n, a in enumerate(actions) if a.kind is Kind.STEP)
    return [*actions[:at], Action(Kind.ALL_REDUCE, actions[at].stage), *actions[at:]]


def train(schedule, *, overlap, share=False, checkpointed=()):
    """Three stages held by one device (those in `checkpointed` under activation
    checkpointing), trained for D steps with doubled gradients; returns the model's weights,
    the executor, its actions and the all-reduces seen."""
    torch.manual_seed(0)
    model = Wide(share)
    x, y = torch.randn(D * G * B, 8), torch.randint(0, 3, (D * G * B,))
    sample = (x[:B], y[:B])
    staged = split_stages(model, sample, {}, [StageSpec(i, i, (b,)) for i, b in enumerate("ABC")])
    routes = routes_of(staged, loss_index=last_output(staged))
    specs = value_specs(staged, sample, {}, training=True)
    stages = [DeviceStage(stage_module(staged.modules[s], checkpoint=s in checkpointed),
                          routes[s], staged.io[s].inputs) for s in range(3)]
    params = list({id(p): p for s in stages for p in s.module.parameters()}.values())
    link = PeerLink(device=CPU, wire_device=CPU, timeout=10)
    link.bucket_bytes = 100 * 4
    executor = StageExecutor(stages, specs, link=link, device=CPU, owners=(0, 0, 0),
                             optimizer=torch.optim.SGD(params, lr=0.1, momentum=0.9))
    actions = with_all_reduce(merge(plan(schedule, 3, G, training=True), (0, 0, 0))[0])
    reduce = Doubling()
    reduce.executor = executor
    call = Call({0: x.reshape(D * G, B, 8), 1: y.reshape(D * G, B)}, D, G, frozenset(), 1 / G,
                overlap=overlap)
    with mock.patch.object(dist, "all_reduce", reduce):
        executor.run(actions, call, training=True)
    return copy.deepcopy(model.state_dict()), executor, actions, reduce.calls


def last_weight_gradient(actions, stage):
    return max(n for n, a in enumerate(actions)
               if a.stage == stage and a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT))


def assert_same(got, want):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_arming_picks_each_stages_last_weight_gradient_action_before_the_step():
    actions = merge(plan("zero_bubble", 2, 3, training=True), (0, 0))[0]
    arms = arming(actions)
    assert sorted(arms.values()) == [0, 1]
    for n, stage in arms.items():
        assert n == last_weight_gradient(actions, stage) and actions[n].kind is Kind.BACKWARD_WEIGHT


def test_buckets_start_inside_each_stages_last_backward_in_order():
    weights, executor, actions, calls = train("pipelined", overlap=True)
    want, _, _, at_step = train("pipelined", overlap=False)
    assert_same(weights, want)  # every element summed once, after its last accumulation
    early = executor.early
    assert len(early.layout) > 10 and len(calls) == D * len(early.layout)
    assert sum(size for *_, size in calls) == sum(size for *_, size in at_step)
    # the last step: each bucket started while a stage's last B ran (its span not yet ended)
    last = calls[-len(early.layout):]
    for action, spans, _ in last:
        n = last_weight_gradient(actions, action.stage)
        assert action == actions[n] and action.kind is Kind.BACKWARD
        assert spans == sum(1 for a in actions[:n] if a.stage == action.stage) + len(
            [a for a in actions if a.stage == action.stage])  # one step's spans before
    assert [s.bucket for s in early.started] == list(range(len(early.layout)))
    assert {s.by for s in early.started} == {"hook"}
    # later stages first: stage 2's last B starts the first bucket, stage 0's the last ones
    assert last[0][0].stage == 2 and last[-1][0].stage == 0
    # without overlap, every bucket waits for the step's AR
    assert {action.kind for action, _, _ in at_step} == {Kind.ALL_REDUCE}


def test_zero_bubble_buckets_start_when_each_stages_last_w_ends():
    weights, executor, actions, calls = train("zero_bubble", overlap=True)
    want, _, _, _ = train("zero_bubble", overlap=False)
    assert_same(weights, want)
    # W assigns .grad itself (no hook fires): a stage's buckets start as its last W ends
    early = executor.early
    assert {s.by for s in early.started} == {"sweep"}
    assert [s.bucket for s in early.started] == list(range(len(early.layout)))
    assert {actions[s.at].kind for s in early.started} == {Kind.BACKWARD_WEIGHT}
    assert all(action.kind is Kind.BACKWARD_WEIGHT for action, _, _ in calls)


def test_a_weight_two_stages_of_the_device_share_is_summed_at_the_step():
    weights, executor, _, calls = train("pipelined", overlap=True, share=True)
    want, _, _, _ = train("pipelined", overlap=False, share=True)
    assert_same(weights, want)
    shared = [p for p in executor.held[1].module.parameters()
              if any(p is q for q in executor.held[2].module.parameters())]
    assert len(shared) == 1 and id(shared[0]) not in executor.early.params
    at_step = [size for action, _, size in calls if action.kind is Kind.ALL_REDUCE]
    assert sum(at_step) == D * 32 * 32  # the shared weight only, at each step's AR
    assert {action.kind for action, _, _ in calls} == {Kind.BACKWARD, Kind.ALL_REDUCE}


def test_a_checkpointed_stage_starts_its_buckets_when_its_last_backward_ends():
    # a recomputed stage's hooks are not trusted (a weight in two checkpointed segments would
    # accumulate twice in one backward): its buckets wait for the end of its last B
    weights, executor, actions, _ = train("pipelined", overlap=True, checkpointed=(1,))
    want, _, _, _ = train("pipelined", overlap=False, checkpointed=(1,))
    assert_same(weights, want)
    early = executor.early
    by_stage = {}
    for started in early.started:
        by_stage.setdefault(actions[started.at].stage, set()).add(started.by)
    assert by_stage == {2: {"hook"}, 1: {"sweep"}, 0: {"hook"}}
    assert [s.bucket for s in early.started] == list(range(len(early.layout)))
