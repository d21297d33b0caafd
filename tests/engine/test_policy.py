"""SpeculationPolicy: shapes and frames in flight chosen from measured links, compute and acceptance."""

from __future__ import annotations

import pytest

from sfchat.engine.policy import EXPLORE_EVERY, Shape, SpeculationPolicy, chain_depths, menu

CHAINS = [Shape(0), Shape(2), Shape(4), Shape(8)]
TREE = Shape(8, 64)


def draft_ms(shape: Shape) -> float:  # a GPU draft: ~1.6 ms a step, the head slice ~3.7 ms
    return 3.7 + 1.6 * shape.depth + (4.0 if shape.budget else 0.0)


def frame_bytes(shape: Shape) -> int:  # 7 KiB of hidden state per position at Qwen2.5-7B
    return 7168 * ((shape.budget or shape.depth) + 1)


def run(policy: SpeculationPolicy, rounds: int, *, accept, rtt_ms=86.0, ms_per_byte=0.0, guess=True,
        tree_tokens=None):
    """Feed ``rounds`` verdicts of whatever the policy chooses; ``accept(depth)`` -> accepted drafts."""
    chosen = []
    for _ in range(rounds):
        shape, m = policy.choose()
        chosen.append((shape, m))
        n = tree_tokens - 1 if shape.budget and tree_tokens else accept(shape.depth)
        full = n >= shape.depth
        size = frame_bytes(shape)
        policy.observe(shape, accepted=n, full=full, sent_bytes=size, rtt_ms=rtt_ms + size * ms_per_byte,
                       tail_ms=4.2, compute_ms=draft_ms(shape), guess_right=guess if full and m > 1 else None)
    return chosen


def settled(chosen):
    """The choice once exploration is over (the most common one of the last rounds)."""
    tail = chosen[-EXPLORE_EVERY + 1:]
    return max(set(tail), key=tail.count)


def test_menus():
    assert menu(8, 0) == [Shape(8)] and menu(8, 64) == [TREE]
    assert menu(8, 0, auto_depth=True) == CHAINS
    assert menu(8, 64, auto_depth=True) == CHAINS + [TREE]
    assert menu(8, 64, auto_tree=True) == [Shape(8), TREE]
    assert menu(3, 0, auto_depth=True) == [Shape(0), Shape(2), Shape(3)]
    assert menu(0, 64, auto_depth=True) == [Shape(0)]
    assert chain_depths(CHAINS + [TREE]) == (0, 2, 4, 8)


def test_every_shape_is_measured_first_deepest_first():
    p = SpeculationPolicy(CHAINS + [TREE], 4)
    chosen = run(p, 5, accept=lambda d: d)
    assert [s for s, _ in chosen] == [TREE, Shape(8), Shape(4), Shape(2), Shape(0)]
    assert all(m == 1 for _, m in chosen)


def test_full_acceptance_over_a_long_round_trip_fills_the_pipeline():
    p = SpeculationPolicy(CHAINS, 8)
    shape, m = settled(run(p, 60, accept=lambda d: d))
    assert shape == Shape(8) and m >= 5  # a ~110 ms round of ~17 ms compute: about six in flight
    assert p.rate(Shape(8), m) > 2 * p.rate(Shape(8), 1)


def test_no_acceptance_sends_one_frame_and_drafts_nothing():
    p = SpeculationPolicy(CHAINS + [TREE], 8)
    shape, m = settled(run(p, 60, accept=lambda d: 0, guess=False))
    assert shape == Shape(0) and m == 1  # drafting costs compute and buys nothing


def test_a_fast_link_and_partial_acceptance_keep_a_short_chain():
    p = SpeculationPolicy(CHAINS, 8)
    shape, m = settled(run(p, 80, accept=lambda d: min(d, 1), rtt_ms=0.5, guess=False))
    # deep drafts cost compute and are rejected; the next token is always the draft's first guess,
    # so a frame in flight lets head and tail work at the same time even over a fast link
    assert shape in (Shape(0), Shape(2)) and m == 2


@pytest.mark.parametrize("ms_per_byte, tree_wins", [(0.0, True), (2e-4, False)])  # loopback; ~5 MB/s
def test_a_tree_is_chosen_only_when_the_link_carries_it(ms_per_byte, tree_wins):
    p = SpeculationPolicy([Shape(8), TREE], 1)
    shape, _ = settled(run(p, 80, accept=lambda d: min(d, 3), ms_per_byte=ms_per_byte, tree_tokens=6))
    assert (shape == TREE) is tree_wins
    if ms_per_byte:
        assert p.ms_per_byte == pytest.approx(ms_per_byte, rel=0.1)  # learned from frames of both sizes


def test_local_mode_and_no_draft_keep_one_frame():
    assert SpeculationPolicy([Shape(0)], 8).max_in_flight == 1
    p = SpeculationPolicy(CHAINS, 1)
    assert all(m == 1 for _, m in run(p, 40, accept=lambda d: d))


def test_shapes_not_chosen_are_run_again_now_and_then():
    p = SpeculationPolicy(CHAINS, 8)
    chosen = run(p, 4 * EXPLORE_EVERY, accept=lambda d: d)
    late = [s for s, _ in chosen[2 * EXPLORE_EVERY:]]
    assert late.count(Shape(8)) > len(late) // 2 and len(set(late)) > 1


def test_the_bonus_after_a_short_chain_is_guessed_as_often_as_a_deeper_draft_is_accepted():
    p = SpeculationPolicy(CHAINS, 8)
    run(p, 10, accept=lambda d: min(d, 1), guess=True)  # one draft of each round accepted, never two
    assert p.expected(Shape(0))[1] == pytest.approx(1.0)  # a first draft is always accepted
    assert p.expected(Shape(2))[1] == pytest.approx(0.0)  # never a second one
    assert p.expected(Shape(8))[1] == 0.0
