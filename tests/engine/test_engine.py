"""Greedy parity of the speculative split engine with transformers' own generate()."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from sfchat import UserError
from sfchat.config import Settings
from sfchat.node.head import Head
from sfchat.protocol.wire import Sampling

from conftest import FAMILIES
from engine_runs import N_NEW, PROMPT, reference, run

TARGETS = [f"{f}-{'tied' if t else 'untied'}" for f, t in FAMILIES]


def load(model, draft, k, **kw):
    return Head.open(Settings(model=str(model), draft=str(draft), k=k, device="cpu", **kw))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_parity_with_unrelated_draft(zoo, target, k):
    session = load(zoo[target], zoo["draft"], k)
    ids = session.encode(PROMPT)
    fin = run(session, ids)
    assert list(fin.token_ids) == reference(zoo[target], ids, N_NEW)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_parity_with_target_as_draft_commits_k_plus_one(zoo, target, k):
    session = load(zoo[target], zoo[target], k)
    ids = session.encode(PROMPT)
    ref = reference(zoo[target], ids, N_NEW)
    fin = run(session, ids)
    assert list(fin.token_ids) == ref
    # Every round but the last accepted all K drafts (the draft never had a KV hole), whether
    # the reply ran to the limit or met EOS first.
    assert fin.finish_reason in ("length", "eos")
    assert fin.rounds == -(-len(ref) // (k + 1))
    assert fin.accepted_histogram[k] >= fin.rounds - 1
    assert fin.tokens_per_round > 1


def test_no_draft_baseline_is_one_token_per_round(zoo):
    session = load(zoo["qwen2-untied"], "none", 8)
    ids = session.encode(PROMPT)
    fin = run(session, ids, 12)
    assert list(fin.token_ids) == reference(zoo["qwen2-untied"], ids, 12)
    assert fin.rounds == len(fin.token_ids) and fin.accepted_histogram == (fin.rounds,)


def test_eos_inside_a_drafted_run_ends_the_reply_there(zoo):
    path = zoo["qwen3-untied"]
    session = load(path, path, 8)
    ids = session.encode(PROMPT)
    free = reference(path, ids, N_NEW)
    stop = free[5]
    cut = free.index(stop)
    session.eos = {stop}
    fin = run(session, ids)
    assert fin.finish_reason == "eos"
    assert list(fin.token_ids) == free[:cut + 1] == reference(path, ids, N_NEW, eos=stop)
    assert fin.rounds == 1  # the EOS sat inside the first drafted run


@pytest.mark.parametrize("n", [1, 2, 8, 9, 10, 17])
def test_max_new_tokens_is_exact(zoo, n):
    path = zoo["llama-tied"]
    session = load(path, path, 8)
    session.eos = set()
    ids = session.encode(PROMPT)
    fin = run(session, ids, n)
    assert fin.finish_reason == "length"
    assert list(fin.token_ids) == reference(path, ids, N_NEW, eos=-1)[:n]


def test_prompt_at_the_context_limit(zoo):
    path = zoo["qwen2-tied"]
    probe = load(path, path, 3, max_context=64)
    ids = probe.encode([{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 3}])
    limit = len(ids) + 1
    session = load(path, path, 3, max_context=limit)
    session.eos = set()
    fin = run(session, ids, 20)
    assert fin.finish_reason == "context"
    assert list(fin.token_ids) == reference(path, ids, 1, eos=-1)
    full = load(path, path, 3, max_context=len(ids))
    with pytest.raises(UserError, match="context window"):
        list(full.reply(ids, 5, Sampling()))


def test_follow_up_turn_reuses_the_cached_context(zoo):
    path = zoo["qwen2-untied"]
    session = load(path, zoo["draft"], 4)
    first = session.encode(PROMPT)
    fin1 = run(session, first, 10)
    messages = PROMPT + [{"role": "assistant", "content": fin1.text}, {"role": "user", "content": "and then?"}]
    second = session.encode(messages)
    events = list(session.reply(second, 10, Sampling()))
    started = events[0]
    common = 0
    for a, b in zip(first + list(fin1.token_ids), second):
        if a != b:
            break
        common += 1
    assert started.reused_tokens >= common - 1 > len(first) // 2
    assert list(events[-1].token_ids) == reference(path, second, 10)


def test_tokenizer_mismatch_is_refused(zoo):
    with pytest.raises(UserError, match="different tokenizer"):
        load(zoo["qwen2-untied"], zoo["foreign-draft"], 4)


def test_split_out_of_range_is_refused(zoo):
    with pytest.raises(UserError, match="out of range"):
        load(zoo["qwen2-untied"], "none", 4, split=9)


@pytest.mark.parametrize("split", [0, 1, 4])
def test_any_split_gives_the_same_tokens(zoo, split):
    path = zoo["llama-untied"]
    session = load(path, zoo["draft"], 3, split=split)
    ids = session.encode(PROMPT)
    assert list(run(session, ids, 12).token_ids) == reference(path, ids, 12)


def test_chat_template_is_applied(zoo):
    session = load(zoo["qwen2-untied"], "none", 1)
    tok = AutoTokenizer.from_pretrained(zoo["tokenizer"])
    text = tok.decode(session.encode(PROMPT))
    assert text.startswith("<|im_start|>user\nhello world") and text.endswith("<|im_start|>assistant\n")
    session.settings.chat_template = False  # --no-chat-template
    assert tok.decode(session.encode(PROMPT)) == PROMPT[0]["content"]
    session.settings.system = "be brief"  # the system prompt rule: the configured one opens the conversation
    session.settings.chat_template = True
    assert tok.decode(session.encode(PROMPT)).startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user")
    own = [{"role": "system", "content": "own"}] + PROMPT  # a conversation with its own keeps it
    assert tok.decode(session.encode(own)).startswith("<|im_start|>system\nown<|im_end|>\n<|im_start|>user")


@pytest.mark.parametrize("draft", ["draft", "qwen3-tied"])
@pytest.mark.parametrize("k", [1, 5])
def test_parity_while_the_context_grows_through_attention_windows(zoo, monkeypatch, draft, k):
    """Windows of 8, 16, 32 ... slots: a reply of 48 tokens crosses several of them in the draft,
    the head and the tail, mid-round included, and still equals generate(), in a follow-up too."""
    from sfchat.model import kv

    monkeypatch.setattr(kv, "MIN_WINDOW", 8)
    target = zoo["qwen3-tied"]
    session = load(target, zoo[draft], k)
    assert session.engine.head.windows[:3] == [8, 16, 32]
    ids = session.encode(PROMPT)
    fin = run(session, ids, 48)
    assert list(fin.token_ids) == reference(target, ids, 48)
    follow = ids + list(fin.token_ids) + ids[-3:]
    assert list(run(session, follow, 16).token_ids) == reference(target, follow, 16)
