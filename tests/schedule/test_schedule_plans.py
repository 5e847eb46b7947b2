"""Schedule functions and actions: exact action lists for small cases and argument errors."""
import pytest

from pipetorch.schedule.actions import Action, Kind
import pipetorch.schedule.plans as plans
from helpers.grid import render
from pipetorch.schedule.plans import fill_drain, one_f_one_b, plan, sharded, zero_bubble


def strs(actions):
    return [str(a) for a in actions]


def test_one_f_one_b_two_stages_three_micro_batches():
    p = plan("pipelined", 2, 3, training=True)
    assert p == one_f_one_b(2, 3)
    # Stage 0 receives each gradient before sending the next activations, as stage 1 sends
    # that gradient before asking for them (the rendezvous order).
    assert strs(p[0]) == ["F0", "S>F0", "F1", "R>B0", "S>F1", "B0", "F2", "R>B1", "S>F2", "B1",
                          "R>B2", "B2", "STEP"]
    assert strs(p[1]) == ["R<F0", "F0", "B0", "S<B0", "R<F1", "F1", "B1", "S<B1",
                          "R<F2", "F2", "B2", "S<B2", "STEP"]


def test_zero_bubble_two_stages_three_micro_batches():
    # 1F1B's transfers in 1F1B's order; each B is followed by its W once stage i holds i
    # newer Bs (stage 1 puts W0 after B1), the rest run before STEP.
    p = plan("zero_bubble", 2, 3, training=True)
    assert p == zero_bubble(2, 3)
    assert strs(p[0]) == ["F0", "S>F0", "F1", "R>B0", "S>F1", "B0", "W0", "F2", "R>B1", "S>F2",
                          "B1", "W1", "R>B2", "B2", "W2", "STEP"]
    assert strs(p[1]) == ["R<F0", "F0", "B0", "S<B0", "R<F1", "F1", "B1", "W0", "S<B1",
                          "R<F2", "F2", "B2", "W1", "S<B2", "W2", "STEP"]
    assert strs(zero_bubble(1, 2)[0]) == ["F0", "B0", "W0", "F1", "B1", "W1", "STEP"]
    assert [a for a in p[1] if a.kind is Kind.BACKWARD_WEIGHT][0] == Action(
        Kind.BACKWARD_WEIGHT, 1, 0)


def test_zero_bubble_inference_is_fill_drain():
    assert plan("zero_bubble", 3, 4, training=False) == fill_drain(3, 4, training=False)


def test_the_zero_bubble_grid_in_the_docstring_is_what_render_draws():
    grid = render(zero_bubble(3, 6))
    assert all(f"    {line}\n" in plans.zero_bubble.__doc__ for line in grid.splitlines())
    assert grid.splitlines()[2] == ("stage 2 |  .  . F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 F4 B4 W2 F5 "
                                    "B5 W3 W4 W5  .  .")


def test_pipelined_inference_is_fill_drain_of_forwards():
    p = plan("pipelined", 2, 2, training=False)
    assert strs(p[0]) == ["F0", "S>F0", "F1", "S>F1"]
    assert strs(p[1]) == ["R<F0", "F0", "R<F1", "F1"]
    assert p == fill_drain(2, 2, training=False)


def test_fill_drain_training_runs_all_forwards_then_all_backwards():
    p = fill_drain(2, 2, training=True)
    assert strs(p[0]) == ["F0", "S>F0", "F1", "S>F1", "R>B0", "B0", "R>B1", "B1", "STEP"]
    assert strs(p[1]) == ["R<F0", "F0", "R<F1", "F1", "B0", "S<B0", "B1", "S<B1", "STEP"]


def test_sharded_takes_each_micro_batch_down_and_back_before_the_next():
    p = plan("sharded", 2, 2, training=True)
    assert strs(p[0]) == ["F0", "S>F0", "R>B0", "B0", "F1", "S>F1", "R>B1", "B1", "STEP"]
    assert strs(p[1]) == ["R<F0", "F0", "B0", "S<B0", "R<F1", "F1", "B1", "S<B1", "STEP"]
    assert strs(sharded(3, 1, training=False)[1]) == ["R<F0", "F0", "S>F0"]


def test_sharded_inference_holds_stage_0_until_the_last_stage_is_done():
    p = sharded(2, 3, training=False)
    assert strs(p[0]) == ["F0", "S>F0", "R>D0", "F1", "S>F1", "R>D1", "F2", "S>F2"]
    assert strs(p[1]) == ["R<F0", "F0", "S<D0", "R<F1", "F1", "S<D1", "R<F2", "F2"]
    assert p[1][2] == Action(Kind.SEND_DONE, 1, 0, 0)


def test_actions_carry_stage_micro_batch_and_peer():
    p = one_f_one_b(3, 4)
    assert p[1][0] == Action(Kind.RECV_ACT, 1, 0, 0)
    assert p[1][2] == Action(Kind.SEND_ACT, 1, 0, 2)
    assert p[2][-1] == Action(Kind.STEP, 2)
    assert all(a.stage == s for s, actions in enumerate(p) for a in actions)


def test_one_stage_needs_no_transfers():
    assert strs(one_f_one_b(1, 2)[0]) == ["F0", "B0", "F1", "B1", "STEP"]
    assert strs(fill_drain(1, 2, training=False)[0]) == ["F0", "F1"]


def test_fewer_micro_batches_than_stages_shortens_the_warm_up():
    # Stage 0 of 4 would warm up with 3 forwards, but only 2 micro-batches exist.
    assert strs(one_f_one_b(4, 2)[0]) == ["F0", "S>F0", "F1", "S>F1", "R>B0", "B0",
                                          "R>B1", "B1", "STEP"]


def test_plan_argument_errors():
    with pytest.raises(ValueError, match="Unknown schedule kind 'gpipe'; use one of "
                                         "pipelined, 1f1b, zero_bubble, fill_drain, sharded"):
        plan("gpipe", 2, 2, training=True)
    with pytest.raises(ValueError, match="needs training=True; use 'fill_drain'"):
        plan("1f1b", 2, 2, training=False)
    with pytest.raises(ValueError, match="stages must be >= 1, got 0"):
        one_f_one_b(0, 2)
    with pytest.raises(ValueError, match="micro_batches must be >= 1, got -1"):
        sharded(2, -1, training=True)
    with pytest.raises(TypeError, match="micro_batches must be an int, got float 2.0"):
        fill_drain(2, 2.0, training=True)


def test_action_validation():
    assert str(Action(Kind.SEND_GRAD, 2, 7, 1)) == "S<B7"
    assert str(Action(Kind.RECV_GRAD, 0, 1, 1)) == "R>B1"
    assert str(Action(Kind.RECV_DONE, 0, 4, 3)) == "R>D4"
    with pytest.raises(ValueError, match="STEP covers every micro-batch and has no peer, "
                                         "got micro_batch=3, peer=None"):
        Action(Kind.STEP, 0, 3)
    with pytest.raises(ValueError, match="FORWARD needs a micro_batch >= 0, got None"):
        Action(Kind.FORWARD, 0)
    with pytest.raises(ValueError, match="SEND_ACT on stage 1 must have a later peer stage, "
                                         "got peer=0"):
        Action(Kind.SEND_ACT, 1, 0, 0)
    with pytest.raises(ValueError, match="RECV_ACT on stage 1 needs a peer stage other than "
                                         "itself, got peer=None"):
        Action(Kind.RECV_ACT, 1, 0)
    with pytest.raises(ValueError, match="BACKWARD runs on its own stage, got peer=1"):
        Action(Kind.BACKWARD, 0, 0, 1)


def test_send_matches_only_the_peers_receive_of_the_same_micro_batch():
    send = Action(Kind.SEND_ACT, 0, 2, 1)
    assert send.matches(Action(Kind.RECV_ACT, 1, 2, 0))
    assert not send.matches(Action(Kind.RECV_ACT, 1, 3, 0))
    assert not send.matches(Action(Kind.SEND_GRAD, 1, 2, 0))
    assert not Action(Kind.FORWARD, 0, 2).matches(Action(Kind.FORWARD, 0, 2))
