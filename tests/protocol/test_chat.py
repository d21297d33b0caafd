"""The chat-over-relay messages: every one round-trips with every field set, every runtime event
travels, and whatever a peer sends that is not one is a ChatError (bounded, typed field by field),
never another exception."""

from __future__ import annotations

import dataclasses
import json
import random
import struct
import typing

import pytest

from sfchat.params import Ask, GenParams
from sfchat.events import (
    CodeWanted, Event, LinkState, LoadProgress, ReplyFinished, ReplyStarted, RoundStats, RuntimeFailed, RuntimeReady,
    TokensCommitted,
)
from sfchat.protocol import chat, chat_events

HOST = "ab" * 16
# every field away from its default, so that a field the codec drops or mixes up shows
STATS = RoundStats(accepted=2, committed=3, draft_ms=5.0, head_ms=3.0, tail_ms=4.0, rtt_ms=80.0, round_ms=100.0,
                   wait_ms=7.5, overlap_ms=1.25, speculated=True, forward_bytes=4096, tree_nodes=64, depth=5,
                   in_flight=2, draft_steps=8, expected=2.7, ahead_steps=3, schedule="stream")


def test_the_stats_of_the_round_trip_test_leave_no_field_at_its_default():
    assert not [f.name for f in dataclasses.fields(RoundStats) if getattr(STATS, f.name) == f.default]


READY = RuntimeReady(model="Qwen/Qwen2.5-7B-Instruct", draft="Qwen/Qwen2.5-0.5B-Instruct", split=14, n_layers=28,
                     dtype="bfloat16", k=8, device="cuda:0", mode="relay", max_context=4096, quant="nf4",
                     tail_dtype="float16", tree_budget=64, shapes=("tree 64, depth 8",), max_in_flight=3)
FIGURES = {k: 1.5 + i for i, k in enumerate(chat_events.FIGURES)}  # each its own value: a swap shows
EVENTS = [LoadProgress("tail", "download", 3, 10, "model.safetensors"), READY, LinkState("connected", "ws://r"),
          ReplyStarted(40, 10, 30, 2), TokensCommitted("Hello\nworld", (1, 2, 3), STATS, 0.25),
          CodeWanted("wrong pairing code"), RuntimeFailed("tail: out of memory", fatal=True),
          chat_events.Finished("length", "Hello\nworld!", 3, 40, 2, (0, 1, 1), 64, FIGURES),
          chat_events.Finished("eos", None, 3, 40, 1, (0, 0, 1), 64, {k: 1.5 for k in chat_events.FIGURES})]
MESSAGES = [chat.Attach("cd" * 16, HOST, 7), chat.Attach("cd" * 16, "", 0),
            chat.Welcome(HOST, True, 7, 3),
            chat.Submit(1, 1, (("system", "be brief"), ("user", "hi <|im_end|>")), Ask(64, GenParams(0.7, 40, 0.9, 1.1, 5))),
            chat.Submit(2, 2, (("user", "hi"),), Ask(64)),  # sampling: the head's
            chat.Cancel(2, 1), chat.NewChat(3), chat.GiveCode(4, "7-crossover-clockwork"), chat.Ack(9),
            *[chat.Update(i + 1, i % 2, e) for i, e in enumerate(EVENTS)], *[chat.Update(99, 5, e) for e in EVENTS]]


def left_at_default(obj, prefix: str = "") -> list[str]:
    """The fields of ``obj`` (and of the dataclasses in it) at their default or empty: a codec that
    dropped one of them would still round-trip."""
    left = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            left += left_at_default(value, f"{prefix}{f.name}.")
        elif value == f.default or not value:
            left.append(prefix + f.name)
    return left


def test_the_round_trip_sets_every_field_of_every_message_and_event():
    full = [m for m in MESSAGES if not left_at_default(m)]
    assert {type(m) for m in full} == set(chat.CLASSES.values())
    assert {type(m.event) for m in full if isinstance(m, chat.Update)} == {*chat_events.TABLES, chat_events.Finished}


def test_every_runtime_event_travels_to_a_chat_client():
    assert set(typing.get_args(Event)) == {*chat_events.TABLES, ReplyFinished}  # a ReplyFinished as a Finished


def test_a_table_that_lacks_a_field_of_its_event_stops_the_import():
    with pytest.raises(ImportError, match="detail"):
        chat_events.fits([(LinkState, {"state": chat_events.Choice(chat_events.LINK_STATES)})])


def test_a_finished_reply_round_trips_every_field():
    values = {f.name: 0.25 + i for i, f in enumerate(dataclasses.fields(ReplyFinished)) if f.type == "float"}
    done = ReplyFinished(finish_reason="length", text="Hello\nworld", token_ids=(5, 6, 7), prompt_tokens=40,
                         rounds=2, accepted_histogram=(0, 1, 1), tree_budget=64, **values)
    assert not left_at_default(done)
    for streamed in (done.text, "Hello"):  # the reply's text streamed, or not all of it
        back = chat.decode(chat.encode(chat.Update(1, 1, chat_events.Finished.of(done, streamed)))).event
        assert chat_events.finished_event(back, streamed, done.token_ids) == done


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__ + "-" + type(getattr(m, "event", m)).__name__)
def test_every_message_round_trips(msg):
    assert chat.decode(chat.encode(msg)) == msg


def test_a_screen_that_sets_no_sampling_leaves_it_to_the_head():
    """The head samples with its flags, else the model's own defaults: a chat screen without
    sampling flags must not send greedy settings of its own (it sent temperature 0 always)."""
    params = chat.decode(chat.encode(chat.Submit(1, 1, (("user", "hi"),), Ask(8)))).params
    assert params.gen == GenParams()


def test_a_screens_repetition_penalty_reaches_the_head():
    sent = Ask(8, GenParams(repetition_penalty=1.2))
    assert chat.decode(chat.encode(chat.Submit(1, 1, (("user", "hi"),), sent))).params.gen.repetition_penalty == 1.2


def frame(kind: chat.ChatType, body: dict | bytes, version: int = chat.CHAT_VERSION, magic: bytes = chat.MAGIC) -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return chat.HEADER.pack(magic, version, kind, len(raw)) + raw


def body_of(msg) -> tuple[chat.ChatType, dict]:
    data = chat.encode(msg)
    return chat.ChatType(data[5]), json.loads(data[chat.HEADER.size:])


def test_framing_is_checked_before_the_body():
    good = chat.encode(chat.Ack(1))
    for bad, why in [(b"", "shorter"), (frame(chat.ChatType.ACK, {"seen": 1}, magic=b"SFCH"), "magic"),
                     (frame(chat.ChatType.ACK, {"seen": 1}, version=2), "version"),
                     (good + b" ", "announced"), (good[:-1], "announced"), (frame(99, {"seen": 1}), "unknown"),
                     (frame(chat.ChatType.ACK, b"[1]"), "object"), (frame(chat.ChatType.ACK, b"\xff"), "JSON"),
                     (frame(chat.ChatType.ACK, b'{"seen": NaN}'), "JSON"), (frame(chat.ChatType.ACK, b'{"seen": 1e999}'), "JSON"),
                     (frame(chat.ChatType.ACK, b"[" * 100000), "JSON")]:
        with pytest.raises(chat.ChatError, match=why):
            chat.decode(bad)
    header = chat.HEADER.pack(chat.MAGIC, chat.CHAT_VERSION, chat.ChatType.ACK, chat.MAX_BODY_BYTES + 1)
    with pytest.raises(chat.ChatError, match="at most"):
        chat.decode(header + b" " * (chat.MAX_BODY_BYTES + 1))


BAD_FIELDS = [
    (chat.Attach("cd" * 16, HOST, 7), [("client", "x" * 32), ("client", "CD" * 16), ("host", "12"), ("seen", -1),
                                       ("seen", 1.0), ("seen", True), ("seen", 1 << 60)]),
    (MESSAGES[3], [("seq", 0), ("request", "1"), ("messages", []), ("messages", [{"role": "tool", "content": "x"}]),
                   ("messages", [{"role": "user"}]), ("messages", [{"role": "user", "content": 5}]),
                   ("messages", [{"role": "user", "content": "x", "extra": 1}]),
                   ("messages", [{"role": "user", "content": "x" * (chat.MAX_CONVERSATION_CHARS + 1)}]),
                   ("messages", [{"role": "user", "content": "x"}] * (chat.MAX_MESSAGES + 1)),
                   ("params", {"max_new_tokens": 0, "temperature": 0, "top_k": 0, "top_p": 1}),
                   ("params", {"max_new_tokens": 5, "temperature": 3, "top_k": 0, "top_p": 1}),
                   ("params", {"max_new_tokens": 5, "temperature": 0, "top_k": 0, "top_p": 0}),
                   ("params", {"max_new_tokens": 5, "temperature": 0, "top_k": 0, "top_p": 1, "seed": 1.5}),
                   ("params", {"max_new_tokens": 5, "repetition_penalty": 0}),
                   ("params", {"max_new_tokens": 5, "repetition_penalty": 10.5}),
                   ("params", {"max_new_tokens": 5, "repetition_penalty": "1.1"}),
                   ("params", [])]),
    (chat.GiveCode(4, "code"), [("code", "x" * (chat.MAX_CODE + 1)), ("code", None)]),
    (chat.Welcome(HOST, True, 7, 3), [("resumed", 1), ("host", ""), ("taken", -2)]),
    (chat.Update(1, 0, EVENTS[0]), [("kind", "nuke"), ("event", []), ("request", -1)]),
]


@pytest.mark.parametrize("msg,bad", BAD_FIELDS, ids=lambda x: type(x).__name__ if not isinstance(x, list) else "")
def test_each_field_is_checked_for_its_type_and_range(msg, bad):
    kind, body = body_of(msg)
    for key, value in bad:
        with pytest.raises(chat.ChatError):
            chat.decode(frame(kind, body | {key: value}))
    for key in body:
        with pytest.raises(chat.ChatError):
            chat.decode(frame(kind, {k: v for k, v in body.items() if k != key}))


EVENT_BAD = {
    "progress": [("node", "relay"), ("stage", ""), ("done", -1), ("detail", "x" * (chat_events.MAX_TEXT + 1))],
    "ready": [("model", ""), ("mode", "cloud"), ("max_context", 0), ("shapes", ["x" * 65]), ("shapes", [1]),
              ("k", "8"), ("split", 1 << 20)],
    "link": [("state", "hacked"), ("detail", 5)],
    "started": [("prompt_tokens", -3), ("dropped_turns", -1), ("dropped_turns", "2")],
    "tokens": [("text", "x" * (chat_events.MAX_CHUNK_CHARS + 1)), ("token_ids", [-1]), ("token_ids", [0.5]),
               ("token_ids", [1] * (chat_events.MAX_CHUNK_TOKENS + 1)), ("stats", {"accepted": 1}), ("elapsed_s", -1.0),
               ("stats", dict(json.loads(json.dumps(STATS.__dict__)), rtt_ms=-5.0))],
    "code_wanted": [("reason", None)],
    "failed": [("fatal", "yes"), ("message", "x" * (chat_events.MAX_TEXT + 1))],
    "finished": [("finish_reason", "crash"), ("tps", -1.0), ("tps", 1e300), ("text", 5),
                 ("accepted_histogram", [1] * (chat_events.MAX_HISTOGRAM + 1)), ("tokens", -1),
                 ("text", "x" * (chat_events.MAX_REPLY_CHARS + 1))],
}


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_each_event_field_is_checked(event):
    kind, body = body_of(chat.Update(1, 0, event))
    fields = body["event"]
    for key, value in EVENT_BAD[body["kind"]]:
        with pytest.raises(chat.ChatError):
            chat.decode(frame(kind, body | {"event": fields | {key: value}}))
    for key in fields:
        if body["kind"] == "finished" and key == "text":
            continue  # a finished reply's own text is optional: the streamed text stands for it
        with pytest.raises(chat.ChatError):
            chat.decode(frame(kind, body | {"event": {k: v for k, v in fields.items() if k != key}}))


def test_the_encoder_cuts_texts_to_their_bounds_and_refuses_what_decode_would():
    long = LinkState("waiting", "x" * 10000)
    assert len(chat.decode(chat.encode(chat.Update(1, 0, long))).event.detail) == chat_events.MAX_TEXT
    with pytest.raises(chat.ChatError):
        chat.encode(chat.Update(1, 0, LinkState("hacked")))
    with pytest.raises(chat.ChatError):
        chat.encode(chat.Update(1, 0, object()))


def test_a_finished_reply_carries_its_text_only_where_it_is_not_the_streamed_text():
    done = ReplyFinished("cancelled", "Hello wor", (1, 2), 40, 2, 1.0, (2,), 10.0, 0.1, 0.05, 90.0, 80.0, 5.0, 3.0, 4.0)
    same = chat_events.Finished.of(done, "Hello wor")
    assert same.text is None
    assert chat_events.finished_event(same, "Hello wor", (1, 2)) == done
    other = chat_events.Finished.of(done, "Hello")
    assert other.text == "Hello wor"
    assert chat_events.finished_event(other, "Hello", (1, 2)) == done


def test_what_a_person_sees_of_an_update_is_plain_text():
    evil = "\x1b]52;c;cHduZWQ=\x07red\x1b[31m\x9b2J"
    shown = [chat_events.update_event(chat.decode(chat.encode(chat.Update(1, 0, e)))) for e in
             (LinkState("waiting", evil), CodeWanted(evil), RuntimeFailed(evil),
              LoadProgress("tail", "load", 1, 2, evil), TokensCommitted(evil + "\nline 2\tx", (1,), STATS, 0.1))]
    for event in shown:
        for value in vars(event).values():
            if isinstance(value, str):
                assert "\x1b" not in value and "\x9b" not in value and "\x07" not in value
    assert shown[-1].text.endswith("\nline 2\tx")  # a reply keeps its line breaks


def test_ten_thousand_mutated_frames_are_refused_as_chat_errors_or_decode():
    rng = random.Random(33)
    seeds = [chat.encode(m) for m in MESSAGES]
    for _ in range(10000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.5 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif op < 0.7:
                data = data[:rng.randrange(len(data) + 1)]
            else:
                data[rng.randrange(len(data) + 1):0] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        if len(data) >= chat.HEADER.size and rng.random() < 0.5:  # a consistent length, to reach the body checks
            struct.pack_into("<I", data, 6, len(data) - chat.HEADER.size)
        try:
            chat.decode(bytes(data))
        except chat.ChatError:
            pass
