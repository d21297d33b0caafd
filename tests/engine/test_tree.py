"""Token trees: greedy parity with generate() for every tree, and the pieces that make it.

The engine with ``tree_budget`` verifies a tree of drafts per round; whatever tree the draft
grows (a draft that agrees with the target, one that does not, the target itself), the
committed tokens must be the target's own greedy ``generate()`` continuation. Below that: the
tree mask equals running each root-to-node path as a chain, the in-place move of the accepted
path leaves the cache as a plain causal prefill would, the walk and the prompt-lookup branch.
"""

from __future__ import annotations

import pytest
import torch

from sfchat.config import Settings
from sfchat.engine import tree as trees
from sfchat.engine.draft import tree_shape
from sfchat.node.head import Head
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.protocol.wire import Sampling

from conftest import FAMILIES
from test_engine import PROMPT, reference, run

TARGETS = [f"{f}-{'tied' if t else 'untied'}" for f, t in FAMILIES]
N_NEW = 40


def load(model, draft, k, budget, **kw):
    return Head.open(Settings(model=str(model), draft=str(draft), k=k, tree_budget=budget, device="cpu", **kw))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("k, budget", [(4, 8), (3, 16)])
def test_tree_parity_with_an_unrelated_draft(zoo, target, k, budget):
    session = load(zoo[target], zoo["draft"], k, budget)
    ids = session.encode(PROMPT)
    fin = run(session, ids, N_NEW)
    assert list(fin.token_ids) == reference(zoo[target], ids, N_NEW)
    assert fin.tree_budget == budget and fin.depth_mean > 1


@pytest.mark.parametrize("target", ["qwen2-untied", "llama-tied"])
def test_tree_with_the_target_as_draft_reaches_full_depth(zoo, target):
    k, budget = 4, 12
    session = load(zoo[target], zoo[target], k, budget)
    ids = session.encode(PROMPT)
    fin = run(session, ids, N_NEW)
    assert list(fin.token_ids) == reference(zoo[target], ids, N_NEW)
    # the draft's likeliest path is the target's own: every full round commits k + 1
    assert fin.accepted_histogram[k] >= fin.rounds - 2


def test_tree_multi_turn_reuse_and_a_weak_draft(zoo):
    """A follow-up turn reuses the cache the tree rounds left (moved in place), with parity."""
    target = zoo["qwen3-tied"]
    session = load(target, zoo["draft"], 5, 24)
    ids = session.encode(PROMPT)
    first = run(session, ids, 24)
    assert list(first.token_ids) == reference(target, ids, 24)
    follow = ids + list(first.token_ids) + session.encode([{"role": "user", "content": "and then?"}])
    events = list(session.reply(follow, 24, Sampling()))
    assert events[0].reused_tokens >= len(ids) + 20  # the tree rounds' positions were kept
    assert list(events[-1].token_ids) == reference(target, follow, 24)


def test_tree_round_frames_carry_parents_and_the_budget(zoo):
    session = load(zoo["qwen2-untied"], zoo["draft"], 4, 8)
    ids = session.encode(PROMPT)
    rounds = [e for e in session.reply(ids, 12, Sampling()) if hasattr(e, "stats")]
    assert all(r.stats.tree_nodes == 8 and 1 <= r.stats.depth <= 4 for r in rounds)
    hidden = session.engine.head.config.hidden_size * 4  # fp32 on the CPU
    assert all(r.stats.forward_bytes > 9 * hidden for r in rounds)


# -- the mechanisms ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def whole(zoo):
    src = ModelSource.open(str(zoo["qwen2-untied"]), None)
    return ModelSlice.load(src, 0, 4, embed=True, head=True, dtype=torch.float32, device=torch.device("cpu"),
                           max_len=128)


def test_tree_attention_equals_each_path_run_as_a_chain(whole):
    context = [5, 17, 33, 90, 12, 7]
    parents = [0, 0, 1, 1, 2, 3, 6]  # t0 -> (1, 2); 1 -> (3, 4); 2 -> 5; 3 -> 6 -> 7
    nodes = [40, 41, 42, 43, 44, 45, 46]
    n = len(context)
    whole.forward(torch.tensor(context[:-1]), torch.arange(n - 1))
    ids = torch.tensor(context[-1:] + nodes)
    mask = trees.mask(parents, n - 1, "cpu")
    got = whole.forward(ids, torch.arange(n - 1, n + len(nodes)), len(nodes) + 1, tree=mask)
    for node in range(1, len(nodes) + 1):
        path, i = [], node
        while i:
            path.append(i)
            i = parents[i - 1]
        chain = context[-1:] + [nodes[j - 1] for j in reversed(path)]
        want = whole.forward(torch.tensor(chain), torch.arange(n - 1, n - 1 + len(chain)), 1)
        torch.testing.assert_close(got[node], want[0], rtol=1e-4, atol=1e-4)


def test_moving_the_accepted_path_leaves_the_cache_of_a_causal_prefill(whole):
    context, parents, nodes = [3, 9, 27, 81], [0, 0, 2, 2, 3], [50, 51, 52, 53, 54]
    n = len(context)
    whole.kv.reset()
    whole.forward(torch.tensor(context[:-1]), torch.arange(n - 1))
    whole.kv.note(0, context[:-1])
    whole.forward(torch.tensor(context[-1:] + nodes), torch.arange(n - 1, n + 5), 1, tree=trees.mask(parents, n - 1, "cpu"))
    whole.kv.note(n - 1, context[-1:])
    path = [2, 3]  # t0 -> node 2 (51) -> node 3 (52)
    whole.keep([n - 1 + i for i in path], n, [51, 52])
    assert whole.kv.written == context + [51, 52]
    keys = [k[:, :, :n + 2].clone() for k in whole.kv.keys]
    whole.kv.reset()
    whole.forward(torch.tensor(context + [51, 52]), torch.arange(n + 2))
    for got, k in zip(keys, whole.kv.keys):
        torch.testing.assert_close(got, k[:, :, :n + 2], rtol=1e-4, atol=1e-4)


def test_walk_follows_the_picks_while_they_are_children():
    parents, tokens = [0, 0, 1, 3], [10, 11, 12, 13]
    picks = [10, 12, 99, 13, 77]  # t0 picks 10 (node 1), node 1 picks 12 (node 3), node 3 picks 13 (node 4)
    assert trees.walk(parents, tokens, picks) == ([1, 3, 4], 77)
    assert trees.walk(parents, tokens, [5, 0, 0, 0, 0]) == ([], 5)


def test_lookup_finds_what_followed_the_latest_occurrence():
    ctx = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 8, 0, 1, 2, 3]
    assert trees.lookup(ctx, 3) == [7, 8, 0]  # the latest "1 2 3" before the end
    assert trees.lookup([1, 2, 3, 4], 3) == []
    assert trees.lookup(ctx, 0) == []


def test_graft_shares_nodes_and_keeps_the_size():
    t = trees.Tree(tokens=[10, 11, 12, 13], parents=[0, 0, 1, 1], scores=[-0.1, -2.0, -0.5, -3.0], fed=[0, 1, -1, -1])
    same = trees.graft(t, [10, 12])
    assert same is t  # the branch is already in the tree
    g = trees.graft(t, [10, 20, 21])
    # the two lowest-scoring leaves (13, 11) made room for 20 under the shared 10, and 21 under it
    assert (g.tokens, g.parents, g.fed) == ([10, 12, 20, 21], [0, 1, 1, 3], [0, -1, -1, -1])
    assert trees.walk(g.parents, g.tokens, [10, 20, 0, 21, 5]) == ([1, 3, 4], 5)
    assert all(p < i for i, p in enumerate(g.parents, start=1))


def test_tree_shape_fills_the_budget():
    for budget, depth in [(8, 8), (64, 8), (128, 8), (256, 4), (64, 1), (16, 2)]:
        width, children, nodes = tree_shape(budget, depth, 150_000)
        assert nodes == budget and width <= children
    assert tree_shape(64, 1, 40)[2] == 40  # a vocabulary smaller than the budget caps it


def test_tree_rounds_through_the_relay_equal_generate(zoo):
    """Relay mode, sealed, real processes: a tree-budget head against a tail told the budget by
    the hello; greedy output equals generate() and --json reports the tree figures."""
    from test_two_machines import generate_reference, head, start_relay, start_tail

    relay, url = start_relay()
    tail = start_tail(url, "trees", zoo["qwen2-untied"].parent)
    target = zoo["qwen2-tied"]
    try:
        _, ref = generate_reference(target, 48)
        out = head(url, "trees", target, zoo["draft"], 4, "--tree-budget", "16", n=48)
        assert out["token_ids"] == ref
        assert out["tree_budget"] == 16 and 1 < out["depth_mean"] <= 4 and out["forward_bytes"] > 17 * 64 * 4
        out = head(url, "trees", target, target, 4, "--tree-budget", "8", n=48)  # a new budget for the same tail
        assert out["token_ids"] == ref and out["tokens_per_round"] > 4
    finally:
        for p in (tail, relay):
            p.terminate()
            p.wait(10)


def test_a_verdict_off_the_tree_is_a_protocol_error_and_commits_nothing(zoo):
    from sfchat.protocol import wire
    from sfchat.engine.round import ProtocolError

    session = load(zoo["qwen2-untied"], zoo["draft"], 3, 8)
    rounds = session.engine.rounds
    rounds.begin(session.encode(PROMPT))
    plan = rounds.plan(Sampling())
    t = plan.tree
    assert t is not None and wire.decode(plan.frames[-1]).parents == tuple(t.parents)
    child = next(i for i in range(2, len(t) + 1) if t.parents[i - 1] != 0)  # a node two deep
    above = t.parents[child - 1]
    before = list(rounds.tokens)

    def v(path, tokens):
        return wire.Verdict(plan.round_id, plan.verify_start, len(path), tuple(tokens), 5, tuple(path))

    sibling = next((i for i in range(1, len(t) + 1) if t.parents[i - 1] == 0 and i != above), None)
    forged = [
        (v([child], [t.tokens[child - 1], 1]), "does not descend the tree"),  # skips its parent
        (v([above, child], [t.tokens[above - 1], t.tokens[above - 1], 1]), "not the tree's nodes"),
        (v([above, len(t) + 1], [t.tokens[above - 1], 1, 1]), "does not descend the tree"),
    ]
    if sibling is not None:
        forged.append((v([sibling, child], [t.tokens[sibling - 1], t.tokens[child - 1], 1]), "does not descend"))
    for verdict, message in forged:
        with pytest.raises(ProtocolError, match=message):
            rounds.take(plan, verdict, set(), 100)
        assert rounds.tokens == before
    commit = rounds.take(plan, v([above, child], [t.tokens[above - 1], t.tokens[child - 1], 7]), set(), 100)
    assert commit.tokens == (t.tokens[above - 1], t.tokens[child - 1], 7)
    assert rounds.head.kv.written == before + [t.tokens[above - 1], t.tokens[child - 1]]


def test_the_tree_holds_the_drafts_own_chain_and_a_graft_never_drops_it(zoo):
    from sfchat.engine.draft import CHAIN_FIRST, Drafter

    src = ModelSource.open(str(zoo["draft"]), None)

    def drafter(**kw):
        model = ModelSlice.load(src, 0, 2, embed=True, head=True, dtype=torch.float32, device=torch.device("cpu"),
                                max_len=256)
        return Drafter(model, 5, **kw)

    ctx = [5, 17, 33, 90, 12, 7, 64, 3]
    chain, _, _ = drafter().propose(ctx, Sampling(), None)
    t = drafter(tree_budget=24).grow(ctx, Sampling())
    first = [i for i in range(1, len(t) + 1) if t.scores[i - 1] > CHAIN_FIRST / 2]
    assert len(first) == 5 and [t.parents[i - 1] for i in first] == [0] + first[:-1]
    assert t.path_tokens(first) == chain
    grafted = trees.graft(t, [chain[0] + 1, 9, 9, 9, 9])  # a branch beside the chain: leaves make room
    path, _ = trees.walk(grafted.parents, grafted.tokens, _picks_along(grafted, chain))
    assert grafted.path_tokens(path) == chain and len(grafted) == 24


def _picks_along(t, tokens):
    """Picks that follow ``tokens`` down the tree as far as they go."""
    picks, node = [-1] * (len(t) + 1), 0
    for tok in tokens:
        picks[node] = tok
        node = next((i for i in range(1, len(t) + 1) if t.parents[i - 1] == node and t.tokens[i - 1] == tok), None)
        if node is None:
            break
    return picks
