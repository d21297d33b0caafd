"""Trust no relay, on loopback: what a relay-side capture of an encrypted session holds, what a
meddling relay achieves (an integrity error that ends the session), clear errors for mismatched
codes. The relay's limits and its behaviour under load are in test_relay_limits.py."""

from __future__ import annotations

import re
import struct
import threading
import time

import pytest

from relay import session as relay_session
from sfchat.protocol import wire
from sfchat.config import Settings
from sfchat.events import LinkState
from sfchat.link.relay import RelayLink
from sfchat.link.secure import DATA, IntegrityError, PlaintextPeer, SecureLink, WrongCode, secure

from threaded_relay import TOKEN, relay  # noqa: F401  (the relay fixture)
from relay_heads import SECRET, open_head, reply, settings

TOKENS = tuple(range(151_000, 151_009))  # a tree frame that is a chain: the root + 8 drafts
PATTERN = b"<known hidden-state pattern 0123456789abcdef>"
HIDDEN = 448
INTEGRITY = "integrity check failed: the relay or the network altered, reordered or replayed a frame"


class Tap:
    """What the relay forwards, as (sender role, bytes); ``meddle(role, frame) -> frames`` may alter it."""

    def __init__(self):
        self.frames: list[tuple[str, bytes]] = []
        self.meddle = None

    def stream(self) -> bytes:
        return b"".join(frame for _, frame in self.frames)


@pytest.fixture
def tap(monkeypatch):
    t = Tap()
    forward = relay_session.Session.forward

    def tapped(session, sender, frame, *timing):  # timing: the emulated delay and bandwidth
        t.frames.append((sender.role, bytes(frame)))
        for out in (t.meddle(sender.role, bytes(frame)) if t.meddle else [frame]):
            forward(session, sender, out, *timing)

    monkeypatch.setattr(relay_session.Session, "forward", tapped)
    return t


def verify_frame(rnd: int) -> bytes:
    hidden = (PATTERN * (len(TOKENS) * HIDDEN * 2 // len(PATTERN) + 1))[:len(TOKENS) * HIDDEN * 2]
    first = 1 + rnd * len(TOKENS)
    parents = (first - 1 if rnd else 0,) + tuple(range(first, first + len(TOKENS) - 1))
    return wire.encode(wire.Forward(round=rnd, tree=1, start_pos=100, tokens=TOKENS, hidden=hidden,
                                    dtype=wire.DType.BFLOAT16, hidden_size=HIDDEN, parents=parents, first_id=first))


def start_verdict_tail(link, rounds: int) -> threading.Thread:
    """A stand-in tail: answers every tree FORWARD with a VERDICT committing all its nodes."""
    def serve_rounds():
        for _ in range(rounds + 1):
            msg = wire.decode(link.recv(10))
            if isinstance(msg, wire.Forward):
                link.send(wire.encode(wire.Verdict(msg.round, msg.tree, tuple(range(len(msg.tokens))), msg.tokens, 7)))
    thread = threading.Thread(target=serve_rounds, daemon=True)
    thread.start()
    return thread


def run_exchange(url: str, secret: str | None, rounds: int = 12) -> None:
    tail_inner = RelayLink(url, TOKEN, "capture", "tail", connect_timeout=5)
    tail = SecureLink(tail_inner, secret, "capture", "tail") if secret else tail_inner
    worker = start_verdict_tail(tail, rounds)
    head_inner = RelayLink(url, TOKEN, "capture", "head", connect_timeout=5)
    head = secure(head_inner, secret, "capture", "head", 5) if secret else head_inner
    try:
        head.send(wire.encode(wire.Control(wire.MsgType.HELLO, {"model": "Example/Private-Model-7B", "k": 8})))
        for rnd in range(rounds):
            head.send(verify_frame(rnd))
            verdict = wire.decode(head.recv(10))
            assert isinstance(verdict, wire.Verdict) and verdict.tokens == TOKENS and verdict.round == rnd
        worker.join(10)
    finally:
        head.close()
        tail.close()


NEEDLES = {
    "token ids": struct.pack(f"<{len(TOKENS)}i", *TOKENS),
    "hidden-state pattern": PATTERN,
    "model name": b"Private-Model",
    "FORWARD header": wire.MAGIC + bytes([wire.PROTOCOL_VERSION, wire.MsgType.FORWARD]),
    "VERDICT header": wire.MAGIC + bytes([wire.PROTOCOL_VERSION, wire.MsgType.VERDICT]),
}


def test_a_relay_side_capture_of_an_encrypted_session_holds_no_plaintext(relay, tap):
    run_exchange(relay.url, SECRET)
    stream = tap.stream()
    assert len(tap.frames) >= 2 * 12 and len(stream) > 12 * len(TOKENS) * HIDDEN * 2
    assert [name for name, needle in NEEDLES.items() if needle in stream] == []


def test_the_same_capture_without_encryption_shows_everything(relay, tap):
    run_exchange(relay.url, None)  # the control: the tap does see what the nodes send
    stream = tap.stream()
    assert [name for name, needle in NEEDLES.items() if needle not in stream] == []


def data_frames_from(role: str, skip: int, change):
    """A meddler that applies ``change`` to the data frames of ``role`` after the first ``skip``."""
    seen = [0]

    def meddle(sender, frame):
        if sender != role or frame[4] != DATA:
            return [frame]
        seen[0] += 1
        return change(frame) if seen[0] > skip else [frame]
    return meddle


def flip(frame: bytes) -> list[bytes]:
    damaged = bytearray(frame)
    damaged[len(frame) // 2] ^= 0x01
    return [bytes(damaged)]


def swap():
    held = []
    return lambda frame: [frame, held.pop()] if held else held.append(frame) or []


@pytest.mark.parametrize("attack, delivered, message", [
    (lambda: flip, 2, "failed authentication"),
    (lambda: lambda frame: [frame, frame], 3, "replayed"),
    (swap, 2, "out of order"),
])
def test_a_meddling_relay_is_caught_by_the_receiver(relay, tap, attack, delivered, message):
    tail = SecureLink(RelayLink(relay.url, TOKEN, "meddle", "tail", connect_timeout=5), SECRET, "meddle", "tail")
    keyed = threading.Thread(target=tail.handshake, args=(5,))
    keyed.start()
    head = secure(RelayLink(relay.url, TOKEN, "meddle", "head", connect_timeout=5), SECRET, "meddle", "head", 5)
    keyed.join(5)
    try:
        tap.meddle = data_frames_from("head", 2, attack())
        for rnd in range(4):
            head.send(verify_frame(rnd))
        assert [wire.decode(tail.recv(5)).round for _ in range(delivered)] == list(range(delivered))
        with pytest.raises(IntegrityError, match=f"{re.escape(INTEGRITY)}.*{message}"):
            tail.recv(5)
        with pytest.raises(IntegrityError):
            tail.recv(5)  # the session is over
    finally:
        head.close()
        tail.close()


# -- whole sessions: tail_node.serve and Head over the relay ---------------------------

def start_tail(s: Settings) -> tuple[threading.Thread, list]:
    from sfchat.node.tail import serve as serve_tail

    result = []
    thread = threading.Thread(target=lambda: result.append(serve_tail(s, once=True)), daemon=True)
    thread.start()
    return thread, result


def test_a_full_encrypted_session_matches_local_mode_and_leaks_nothing(zoo, relay, tap, monkeypatch):
    from sfchat.node.head import Head

    sealed = []  # every plaintext frame a node sealed, to look for in the capture
    seal = SecureLink.send
    monkeypatch.setattr(SecureLink, "send", lambda self, frame: (sealed.append(bytes(frame)), seal(self, frame))[1])
    model = zoo["qwen2-untied"]
    tail, result = start_tail(settings(relay.url, "full", model))
    head = open_head(settings(relay.url, "full", model, draft=str(zoo["draft"]), k=3), [])
    out, prompt_ids = reply(head)
    head.engine.link.close()
    tail.join(20)
    local = Head.open(Settings(model=str(model), draft=str(zoo["draft"]), k=3, device="cpu"))
    assert out.token_ids == reply(local)[0].token_ids and result == [0]

    stream = tap.stream()
    messages = [wire.decode(frame) for frame in sealed]
    forwards = [m for m in messages if isinstance(m, wire.Forward)]
    assert forwards and any(isinstance(m, wire.Verdict) for m in messages)
    needles = [struct.pack(f"<{len(prompt_ids)}i", *prompt_ids), str(model).encode()]
    needles += [f.hidden[i:i + 32] for f in forwards for i in range(0, len(f.hidden) - 32, 509)]
    assert not [n for n in needles if n in stream]
    assert all(frame not in stream for frame in sealed if len(frame) >= 16)


@pytest.mark.parametrize("sender", ["head", "tail"])
def test_a_flipped_bit_in_transit_ends_the_session_with_an_integrity_error(zoo, relay, tap, sender):
    model = zoo["llama-tied"]
    tail, result = start_tail(settings(relay.url, f"flip-{sender}", model))
    events = []
    head = open_head(settings(relay.url, f"flip-{sender}", model), events)
    tap.meddle = data_frames_from(sender, 0, flip)  # armed once the head is connected and loaded
    with pytest.raises(Exception, match=re.escape(INTEGRITY)) as failure:
        reply(head)
    head.engine.link.close()
    tail.join(20)
    assert not any(isinstance(e, LinkState) and e.state == "reconnecting" for e in events)  # not retried
    if sender == "head":  # the tail caught it and told the head
        assert str(failure.value).startswith("tail: " + INTEGRITY) and result == [1]
    else:
        assert isinstance(failure.value, IntegrityError) and result == [0]


def test_a_wrong_code_is_a_clear_error_on_the_head_and_the_tail_waits_for_the_right_one(zoo, relay, capfd):
    tail, result = start_tail(settings(relay.url, "wrong", zoo["llama-tied"]))
    t0 = time.monotonic()
    with pytest.raises(WrongCode, match="wrong pairing code"):
        open_head(settings(relay.url, "wrong", zoo["llama-tied"], secret="not the tail's code"), [])
    # the head's answer is one exchange of messages on loopback: 10 s is a hang's mark, not a speed
    assert time.monotonic() - t0 < 10 and result == []  # the tail is still serving
    head = open_head(settings(relay.url, "wrong", zoo["llama-tied"]), [])
    reply(head, 4)
    head.engine.link.close()
    tail.join(20)
    assert result == [0]
    assert "a pairing attempt failed" in capfd.readouterr().err


def test_an_unencrypted_tail_and_an_unencrypted_head_are_named_as_such(zoo, relay):
    tail, _ = start_tail(settings(relay.url, "plain-tail", zoo["llama-tied"], secret=None, insecure=True))
    with pytest.raises(PlaintextPeer, match="the tail sent an unencrypted frame"):
        open_head(settings(relay.url, "plain-tail", zoo["llama-tied"]), [])
    tail.join(20)

    tail, result = start_tail(settings(relay.url, "plain-head", zoo["llama-tied"]))
    head = RelayLink(relay.url, TOKEN, "plain-head", "head", connect_timeout=5)
    head.wait_peer(5)
    head.send(wire.encode(wire.Control(wire.MsgType.HELLO, {"model": "x"})))
    answer = head.recv(10)
    answer = wire.decode(answer)
    assert "this tail encrypts end to end" in answer.data["message"]
    head.close()
    tail.join(20)
    assert result == [1]
