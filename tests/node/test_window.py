"""A conversation longer than the context window: the oldest whole turns are left out, the system
prompt and the newest message never are, and the same start is kept while it fits (its K/V is
cached). Token counts are the real ones of the tests' tiny ChatML tokenizer."""

from __future__ import annotations

import pytest
import tinymodels

from sfchat import UserError
from sfchat.node.prompts import encode
from sfchat.node.window import ContextWindow, turn_starts

SYSTEM = {"role": "system", "content": "be brief"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tinymodels.make_tokenizer(tmp_path_factory.mktemp("tok"))


def chat(n_turns: int, system: bool = True) -> list[dict]:
    """``n_turns`` user+assistant pairs and a newest user message, each of a few dozen tokens."""
    out = [SYSTEM] if system else []
    for i in range(n_turns):
        out += [{"role": "user", "content": f"question {i}: the quick brown fox jumps over the lazy dog"},
                {"role": "assistant", "content": f"answer {i}: speculative decoding drafts tokens"}]
    return out + [{"role": "user", "content": "and then? hello world, how are you today?"}]


def kept(messages: list[dict], dropped: int) -> list[dict]:
    """The conversation with its ``dropped`` oldest pairs left out, by hand."""
    system = [messages[0]] if messages[0]["role"] == "system" else []
    return system + messages[len(system) + 2 * dropped:]


def test_a_conversation_that_fits_is_kept_whole(tok):
    messages = chat(2)
    fitted = ContextWindow(4096).fit(messages, 64, lambda m: encode(tok, m))
    assert fitted.dropped == 0 and fitted.ids == encode(tok, messages)


def test_past_the_window_the_oldest_pairs_go_down_to_half_the_window(tok):
    messages = chat(12)
    size = len(encode(tok, messages))
    window = ContextWindow(size)  # the whole conversation leaves the reply no room
    fitted = window.fit(messages, 64, lambda m: encode(tok, m))
    n = fitted.dropped
    assert 0 < n < 12
    assert fitted.ids == encode(tok, kept(messages, n))  # the system prompt, then the newest pairs
    assert len(fitted.ids) <= size // 2 < len(encode(tok, kept(messages, n - 1)))  # the fewest that do


def test_the_next_turn_keeps_the_same_start_while_it_fits(tok):
    messages = chat(12)
    window = ContextWindow(len(encode(tok, messages)))
    first = window.fit(messages, 64, lambda m: encode(tok, m))
    longer = messages + [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "more"}]
    second = window.fit(longer, 64, lambda m: encode(tok, m))
    assert second.dropped == first.dropped  # fewer would fit as well, but this start is cached
    assert second.ids[:len(first.ids) - 4] == first.ids[:len(first.ids) - 4]
    window.forget()  # a new chat: the fewest again
    assert window.fit(longer, 64, lambda m: encode(tok, m)).dropped <= first.dropped


def test_an_edited_start_is_fitted_afresh(tok):
    messages = chat(12)
    window = ContextWindow(len(encode(tok, messages)))
    first = window.fit(messages, 64, lambda m: encode(tok, m))
    edited = [SYSTEM, {"role": "user", "content": "hello"}] + messages[2:]
    again = window.fit(edited, 64, lambda m: encode(tok, m))
    assert again.ids == encode(tok, kept(edited, again.dropped)) and again.dropped >= first.dropped


def test_the_reply_keeps_its_room_when_the_last_turns_are_long(tok):
    long_turn = [{"role": "user", "content": "the quick brown fox " * 20},
                 {"role": "assistant", "content": "jumps over the lazy dog " * 20}]
    messages = chat(3)[:-1] + long_turn + chat(0, system=False)
    alone = len(encode(tok, kept(messages, 4)))
    size = alone + 30  # half the window cannot hold the long turn; the reply's room can, with it left out
    with_long = len(encode(tok, kept(messages, 3)))
    assert with_long > size - 16
    fitted = ContextWindow(size).fit(messages, 16, lambda m: encode(tok, m))
    assert fitted.dropped == 4 and len(fitted.ids) == alone
    # room or not, the newest message with the system prompt is sent when it fits at all
    assert ContextWindow(alone + 1).fit(messages, 16, lambda m: encode(tok, m)).dropped == 4


def test_a_newest_message_longer_than_the_window_is_an_error(tok):
    messages = chat(2)
    alone = len(encode(tok, kept(messages, 2)))
    with pytest.raises(UserError, match="--max-context"):
        ContextWindow(alone).fit(messages, 16, lambda m: encode(tok, m))


def test_turns_begin_at_user_messages(tok):
    # a reply that produced nothing is left out of the conversation: two user messages in a row
    messages = [SYSTEM, {"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]
    assert turn_starts(messages) == [1, 2, 4]
    assert turn_starts(messages[1:]) == [0, 1, 3]
    assert turn_starts([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]) == [0, 1]
    size = len(encode(tok, [SYSTEM] + messages[2:])) + 1
    fitted = ContextWindow(size).fit(messages, 1, lambda m: encode(tok, m))
    assert fitted.dropped == 1 and fitted.ids == encode(tok, [SYSTEM] + messages[2:])
