"""Re-balancing advice from a run's summary: bottleneck, ratio and the proposed move."""
from pipetorch.profiling.rebalance import Move, advice, propose


def _summary(blocks, compute_ms):
    return {"stages": [{"index": i, "ipu": i, "blocks": b} for i, b in enumerate(blocks)],
            "timing": {"per_device": [{"stage": i, "compute_ms": c}
                                      for i, c in enumerate(compute_ms)]}}


def test_moves_a_block_from_the_bottleneck_to_its_lighter_neighbour():
    move = propose([["B1"], ["B2", "B3", "B4"]], [10.0, 90.0])
    assert move == Move("B2", 1, 0, 90.0, 60.0)
    assert move.gain == 1.5


def test_advice_names_bottleneck_ratio_and_move():
    text = advice(_summary([["B1"], ["B2", "B3", "B4"]], [10.0, 90.0]))
    assert "stage 1 is the bottleneck, 90.0 ms" in text and "9.00x" in text
    assert "Move block 'B2' from stage 1 to stage 0 (ipu_id=0)" in text
    assert "predicted slowest stage 60.0 ms, 1.50x faster" in text


def test_balanced_run_and_single_block_stages():
    assert "balanced within 10%" in advice(_summary([["A"], ["B"]], [10.0, 10.5]))
    assert "No whole block can move" in advice(_summary([["A"], ["B"]], [10.0, 30.0]))
    assert propose([["A", "B"], ["C"]], [30.0, 30.0]) is None  # no move lowers the max
    assert advice({"stages": [], "timing": {"per_device": []}}) is None
