"""The live speculation tree without models: values, frames chosen best first across frames in
flight, verdicts checked and the root moved, calibration, and the scratch slots behind it."""

from __future__ import annotations

import pytest

from sfchat.engine.live import Calibration, LiveTree, ProtocolError

VOCAB = 100


def grown(tree: LiveTree, proposals: dict[tuple[int, ...], list[tuple[int, float]]]) -> None:
    """Expand the nodes named by their token paths from the root (the root itself: ())."""
    for path, props in proposals.items():
        node = tree.root
        for t in path:
            node = node.children[t]
        tree.expanded(node, props)


def path_of(node, tree) -> tuple[int, ...]:
    return tuple(n.token for n in node.path_to(None)[1:])


def test_values_are_products_of_calibrated_steps_and_frames_go_best_first():
    tree = LiveTree([1, 2, 3])
    grown(tree, {(): [(10, 0.6), (11, 0.3)], (10,): [(20, 0.9), (21, 0.05)]})
    cal = tree.calibration
    frame = tree.choose(4, max_pos=100)
    tree.send(frame)
    assert [path_of(n, tree) for n in frame] == [(), (10,), (10, 20), (11,)]
    assert frame[0] is tree.root and tree.value(tree.root) == 1.0
    assert tree.value(frame[2]) == pytest.approx(cal.step(0.6, 0) * cal.step(0.9, 0))
    assert [n.id for n in frame] == [1, 2, 3, 4] and all(tree.parent_id(n) < n.id for n in frame)
    assert tree.parent_id(frame[0]) == 0  # the root of a new tree hangs under the context


def test_the_expected_yield_of_a_frame_from_the_root_counts_sent_nodes_too():
    tree = LiveTree([1, 2, 3])
    grown(tree, {(): [(10, 0.6), (11, 0.3)], (10,): [(20, 0.9), (21, 0.05)]})
    value = {path_of(n, tree): tree.value(n) for n in tree.nodes()}
    root = tree.root.pos
    assert tree.expected(3, 100) == pytest.approx((1.0 + value[(10,)] + value[(10, 20)], root + 2))  # the best three
    tree.send(tree.choose(2, 100))  # the root and 10 in flight: a frame from the root would carry them again
    assert tree.expected(3, 100) == pytest.approx((1.0 + value[(10,)] + value[(10, 20)], root + 2))
    assert tree.expected(100, 100) == pytest.approx((sum(value.values()), root + 2))
    assert tree.expected(0, 100) == (0.0, root)
    assert tree.expected(3, root + 2) == pytest.approx((1.0 + value[(10,)] + value[(11,)], root + 1))  # one step deep


def test_a_frame_in_flight_hangs_under_nodes_of_earlier_frames_and_hedges_their_outcomes():
    tree = LiveTree([1, 2, 3])
    grown(tree, {(): [(10, 0.9), (11, 0.05)], (10,): [(20, 0.9), (21, 0.05)]})
    first = tree.choose(3, 100)  # the root, 10, 20
    tree.send(first)
    grown(tree, {(10, 20): [(30, 0.9)], (11,): [(40, 0.5)]})
    second = tree.choose(3, 100)
    tree.send(second)
    assert [path_of(n, tree) for n in second] == [(10, 20, 30), (11,), (10, 21)]  # below and beside
    assert [tree.parent_id(n) for n in second] == [first[2].id, first[0].id, first[1].id]
    assert second[0].id == 4  # ids go on across frames


def test_a_verdict_moves_the_root_and_what_is_not_below_it_dies():
    tree = LiveTree([1, 2, 3])
    grown(tree, {(): [(10, 0.9), (11, 0.05)], (10,): [(20, 0.9), (21, 0.05)]})
    frame = tree.choose(5, 100)
    tree.send(frame)
    index = {path_of(n, tree): i for i, n in enumerate(frame)}
    tokens, dead = tree.take(frame, (index[()], index[(10,)]), (10, 21), VOCAB)  # the target picked 21 after 10
    assert tokens == [10, 21] and {path_of(n, tree) for n in dead} >= {(11,), (10, 20)}
    assert tree.root.token == 21 and tree.root.pos == 4 and tree.root.sent and tree.root.parent is None
    assert tree.root_parent_id == frame[index[(10,)]].id
    assert {n.token for n in tree.nodes()} == {21}  # 11 and 20 died with the outcome


def test_a_pick_nobody_proposed_becomes_a_new_root_to_send():
    tree = LiveTree([1, 2, 3])
    grown(tree, {(): [(10, 0.9)]})
    frame = tree.choose(2, 100)
    tree.send(frame)
    assert tree.take(frame, (0, 1), (10, 55), VOCAB)[0] == [10, 55]
    assert tree.root.token == 55 and not tree.root.sent and tree.root.pos == 4
    nxt = tree.choose(3, 100)
    assert nxt == [tree.root]  # the next frame starts with it


@pytest.mark.parametrize("path, picks, why", [
    ((), (), "holds the root"),  # the root was in the frame: the walk must reach it
    ((1,), (3,), "start at the root"),
    ((0, 2), (10, 4), "picks down the tree"),  # 2 is not the child of 0 that the pick names
    ((0, 1), (11, 4), "picks down the tree"),  # the pick after the root was not 10
    ((0, 9), (10, 4), "does not have"),
    ((0,), (VOCAB,), "outside the vocabulary"),
])
def test_an_impossible_verdict_is_a_protocol_error_and_moves_nothing(path, picks, why):
    tree = LiveTree([1, 2, 3])
    grown(tree, {(): [(10, 0.9), (12, 0.05)], (10,): [(20, 0.9)]})
    frame = tree.choose(4, 100)
    tree.send(frame)
    root = tree.root
    with pytest.raises(ProtocolError, match=why):
        tree.take(frame, path, picks, VOCAB)
    assert tree.root is root


def test_a_frame_that_cannot_hold_the_root_gets_an_empty_verdict():
    tree = LiveTree([1, 2, 3])
    grown(tree, {(): [(10, 0.9)], (10,): [(20, 0.9)]})
    first = tree.choose(2, 100)
    tree.send(first)
    second = tree.choose(1, 100)  # 20, below 10
    tree.send(second)
    tree.take(first, (0,), (11,), VOCAB)  # the target picked 11, not 10: the second frame is dead
    assert tree.take(second, (), (), VOCAB) == ([], [])
    with pytest.raises(ProtocolError, match="start at the root"):
        tree.take(second, (0,), (5,), VOCAB)


def test_frames_stop_at_the_context_window_and_keep_parents_first():
    tree = LiveTree([1, 2, 3])
    grown(tree, {(): [(10, 0.9)], (10,): [(20, 0.9)], (10, 20): [(30, 0.9)]})
    frame = tree.choose(10, max_pos=5)
    assert [n.pos for n in frame] == [2, 3, 4]
    assert tree.choose(10, max_pos=2) == []


def test_the_calibration_learns_what_the_target_picks_per_rank_and_confidence():
    cal = Calibration(ranks=4)
    assert cal.step(0.42, 0) == pytest.approx(0.425, abs=0.03)  # the prior: the draft's own probability
    tree = LiveTree([1, 2, 3], cal)
    for _ in range(200):  # the target always picks the draft's second choice
        grown(tree, {(): [(10, 0.5), (11, 0.4)]})
        frame = tree.choose(1, 1000)
        tree.send(frame)
        tree.take(frame, (0,), (11,), VOCAB)
    assert cal.step(0.4, 1) > 0.9 and cal.step(0.5, 0) < 0.1
    assert cal.ranks[1] == 200 and sum(cal.ranks) == 200


def test_a_lookup_continuation_hangs_under_the_root_and_shares_nodes():
    tree = LiveTree([1, 2, 3])
    grown(tree, {(): [(10, 0.9)]})
    tree.graft([10, 11, 12])
    assert tree.root.children[10].q == 0.9  # shared with the draft's proposal
    leaf = tree.root.children[10].children[11].children[12]
    assert leaf.q is None and leaf.step == tree.calibration.step(None)
