"""Trees of drafts: greedy parity with generate() for every tree, and the pieces that make it.

With ``tree_budget`` each frame carries that many drafts of the live tree; whatever tree the draft
grows (a draft that agrees with the target, one that does not, the target itself), the committed
tokens must be the target's own greedy ``generate()`` continuation. Below that: the tree mask
equals running each root-to-node path as a chain, the in-place move of a committed path leaves the
cache as a plain causal prefill would, and the prompt-lookup continuation.
"""

from __future__ import annotations

import pytest
import torch

from sfchat.engine.scratch import Scratch

from sfchat.config import Settings
from sfchat.engine.lookup import lookup
from sfchat.node.head import Head
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.protocol.wire import Sampling

from conftest import FAMILIES
from tree_masks import tree_mask
from engine_runs import PROMPT, reference, run

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
    assert fin.tree_budget == budget


@pytest.mark.parametrize("target", ["qwen2-untied", "llama-tied"])
def test_tree_with_the_target_as_draft_reaches_full_depth(zoo, target):
    k, budget = 4, 12
    session = load(zoo[target], zoo[target], k, budget)
    ids = session.encode(PROMPT)
    fin = run(session, ids, N_NEW)
    assert list(fin.token_ids) == reference(zoo[target], ids, N_NEW)
    # the draft's likeliest continuation is the target's own: once calibrated, frames commit deep paths
    assert fin.tokens_per_round > k / 2


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


def test_tree_frames_carry_the_budget_and_their_hidden_states(zoo):
    session = load(zoo["qwen2-untied"], zoo["draft"], 4, 8)
    ids = session.encode(PROMPT)
    rounds = [e for e in session.reply(ids, 12, Sampling()) if hasattr(e, "stats")]
    assert all(1 <= r.stats.tree_nodes <= 9 and r.stats.depth >= 1 for r in rounds)
    assert max(r.stats.tree_nodes for r in rounds) == 9  # the root and the budget's 8 drafts
    hidden = session.engine.head.config.hidden_size * 4  # fp32 on the CPU
    assert all(r.stats.forward_bytes > r.stats.tree_nodes * hidden for r in rounds)


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
    mask = tree_mask(parents, n - 1)
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
    whole.reset()
    whole.forward(torch.tensor(context[:-1]), torch.arange(n - 1))
    whole.note(0, context[:-1])
    whole.forward(torch.tensor(context[-1:] + nodes), torch.arange(n - 1, n + 5), 1, tree=tree_mask(parents, n - 1))
    whole.note(n - 1, context[-1:])
    scratch = Scratch(whole, len(nodes) + 1)  # the nodes were written at slots n, n + 1, ...
    scratch.reset(n)
    assert [scratch.take(i) for i in range(1, len(nodes) + 1)] == list(range(n, n + len(nodes)))
    scratch.commit([2, 3], [51, 52])  # t0 -> node 2 (51) -> node 3 (52)
    assert whole.cached_tokens() == context + [51, 52]
    keys = [k[:, :, :n + 2].clone() for k in whole.kv_tensors()]
    whole.reset()
    whole.forward(torch.tensor(context + [51, 52]), torch.arange(n + 2))
    for got, k in zip(keys, whole.kv_tensors()):
        torch.testing.assert_close(got, k[:, :, :n + 2], rtol=1e-4, atol=1e-4)


def test_lookup_finds_what_followed_the_latest_occurrence():
    ctx = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 8, 0, 1, 2, 3]
    assert lookup(ctx, 3) == [7, 8, 0]  # the latest "1 2 3" before the end
    assert lookup([1, 2, 3, 4], 3) == []
    assert lookup(ctx, 0) == []


def test_tree_rounds_through_the_relay_equal_generate(zoo):
    """Relay mode, sealed, real processes: a tree-budget head against a tail told the budget by
    the hello (and then one row count for every forward); greedy output equals generate() and
    --json reports the tree figures."""
    from machines import generate_reference, head, start_relay, start_tail

    relay, url = start_relay()
    tail = start_tail(url, "trees", zoo["qwen2-untied"].parent)
    target = zoo["qwen2-tied"]
    try:
        _, ref = generate_reference(target, 48)
        out = head(url, "trees", target, zoo["draft"], 4, "--tree-budget", "16", n=48)
        assert out["token_ids"] == ref
        assert out["tree_budget"] == 16 and out["depth_mean"] >= 1 and out["forward_bytes"] > 64 * 4
        # a new budget for the same tail; one frame per round trip, as the measured policy may choose
        # a stream of shallow frames (about 2 tokens each) on a loaded machine
        out = head(url, "trees", target, target, 4, "--tree-budget", "8", "--max-in-flight", "1", n=48)
        assert out["token_ids"] == ref and out["tokens_per_round"] > 2
        # one row count for every forward of the target (a GPU's default), frames in flight as the policy
        # picks: the same tail reloads its slice for the one-shape hello, canonical attention and all
        out = head(url, "trees", target, zoo["draft"], 4, "--tree-budget", "16", "--frame-rows", "24", n=48)
        assert out["token_ids"] == ref
    finally:
        for p in (tail, relay):
            p.terminate()
            p.wait(10)
