"""SecureLink over an in-memory stand-in for the relay whose tap can read, alter, drop, reorder and
replay frames: what an operator of the relay (or anyone on the path) could do."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, strategies as st

from sfchat import UserError
from sfchat.link import PeerGone
from sfchat.link.secure import (
    DATA, DATA_HEADER_BYTES, MAGIC, OVERHEAD, IntegrityError, SecureLink, WrongCode,
)
from sfchat.link import secure as secure_link
from sfchat.link.padding import MIN_PADDED, padded_size
from sfchat.link.pairing import Passcode, require_secret
from sfchat.protocol.wire import MAX_DEPTH, Verdict, encode

from sealed_pairs import SECRET, Relay, fuzz, handshake_both, pair


def data_frames(relay: Relay, role: str) -> list[bytes]:
    return [f for r, f in relay.captured if r == role and f[4] == DATA]


def test_frames_round_trip_both_ways_and_the_relay_sees_none_of_them():
    relay, head, tail = pair()
    down = [b"", b"x", bytes(range(256)) * 300] + [struct.pack("<9i", *range(i, i + 9)) for i in range(50)]
    up = [b"verdict %d" % i for i in range(50)]
    for frame in down:
        head.send(frame)
    assert [tail.recv(1) for _ in down] == down
    for frame in up:
        tail.send(frame)
    assert [head.recv(1) for _ in up] == up
    wire = b"".join(f for _, f in relay.captured)
    assert bytes(range(256)) not in wire and b"verdict" not in wire
    assert all(struct.pack("<9i", *range(i, i + 9)) not in wire for i in range(50))
    assert [len(f) - OVERHEAD for f in data_frames(relay, "head")] == [padded_size(len(f) + 1) for f in down]


def test_padding_hides_verdict_contents_and_rounds_big_frames_up_by_less_than_an_eighth():
    relay, head, tail = pair()
    verdicts = [encode(Verdict(7, 100, tuple(range(n)), tuple(range(n)), 1234)) for n in range(1, MAX_DEPTH + 1)]
    assert len({len(v) for v in verdicts}) == MAX_DEPTH
    for v in verdicts:
        tail.send(v)
    assert [head.recv(1) for _ in verdicts] == verdicts
    assert {len(f) for f in data_frames(relay, "tail")} == {MIN_PADDED + OVERHEAD}  # one size for all
    sizes = [padded_size(n) for n in range(1, 1 << 18)]
    assert all(n <= size < max(MIN_PADDED + 1, n * 9 / 8) for n, size in enumerate(sizes, 1))
    # eight lengths per power of two (the ninth is the next power itself)
    assert set(sizes[(1 << 16) - 1:(1 << 17) - 1]) == {(8 + i) << 13 for i in range(9)}
    assert padded_size(64_606) == 65_536  # a K=8 verify FORWARD of Qwen2.5-7B, with its pad mark


def test_an_authentic_frame_with_broken_padding_is_refused(monkeypatch):
    relay, head, tail = pair()
    monkeypatch.setattr(secure_link, "pad", bytes)  # a peer that seals without padding
    head.send(b"no pad mark")
    with pytest.raises(IntegrityError, match="badly padded"):
        tail.recv(1)


def test_frames_sent_before_the_pairing_are_held_then_delivered():
    relay = Relay()
    head = SecureLink(relay.join("head"), SECRET, "s1", "head")
    head.send(b"hello before any tail")  # no peer: held, not dropped by the relay
    assert relay.captured == []
    tail = SecureLink(relay.join("tail"), SECRET, "s1", "tail")
    with pytest.raises(TimeoutError):
        tail.recv(0.05)  # the head has not opened a pairing yet
    handshake_both(head, tail)
    assert tail.recv(1) == b"hello before any tail"


@pytest.mark.parametrize("where", ["counter", "ciphertext", "tag"])
def test_a_flipped_bit_is_an_integrity_error_that_ends_the_link(where):
    relay, head, tail = pair()
    head.send(b"first")
    assert tail.recv(1) == b"first"
    offset = {"counter": DATA_HEADER_BYTES - 1, "ciphertext": DATA_HEADER_BYTES + 2, "tag": -1}[where]

    def flip(sender, frame):
        damaged = bytearray(frame)
        damaged[offset] ^= 0x10
        return [bytes(damaged)]

    relay.tap = flip
    head.send(b"second frame")
    with pytest.raises(IntegrityError, match="integrity check failed: the relay or the network altered"):
        tail.recv(1)
    relay.tap = None
    head.send(b"third")
    with pytest.raises(IntegrityError):  # final: the session is over
        tail.recv(1)


def test_a_replayed_frame_is_refused():
    relay, head, tail = pair()
    relay.tap = lambda sender, frame: [frame, frame]
    head.send(b"pay 10")
    assert tail.recv(1) == b"pay 10"
    with pytest.raises(IntegrityError, match="replayed"):
        tail.recv(1)


def test_reordered_and_dropped_frames_are_refused():
    relay, head, tail = pair()
    held = []
    relay.tap = lambda sender, frame: held.append(frame) or []
    head.send(b"one")
    head.send(b"two")
    relay.deliver("tail", held[1])
    with pytest.raises(IntegrityError, match="out of order"):
        tail.recv(1)

    relay, head, tail = pair()
    head.send(b"kept")
    assert tail.recv(1) == b"kept"
    relay.tap = lambda sender, frame: []
    head.send(b"dropped")
    relay.tap = None
    head.send(b"after the gap")
    with pytest.raises(IntegrityError, match="expected #1"):
        tail.recv(1)


def test_frames_reflected_to_their_sender_are_refused():
    relay, head, tail = pair()
    head.send(b"to the tail")
    relay.deliver("head", data_frames(relay, "head")[-1])
    with pytest.raises(IntegrityError):
        head.recv(1)


@pytest.mark.parametrize("garbage", [b"", b"SFX", MAGIC, MAGIC + b"\x05" + bytes(20), MAGIC + b"\x09" + bytes(40),
                                     MAGIC + b"\x01" + bytes(10), MAGIC + b"\x01" + bytes(65),
                                     MAGIC + b"\x03" + bytes(32), b"SFX1\x01" + bytes(134), bytes(1000)])
def test_injected_garbage_is_an_integrity_error(garbage):
    relay, head, tail = pair()
    relay.deliver("tail", garbage)
    with pytest.raises(IntegrityError):
        tail.recv(1)


def test_a_wrong_code_is_a_clear_error_on_the_head_and_the_tail_waits_for_the_next_attempt():
    relay = Relay()
    logged = []
    tail = SecureLink(relay.join("tail"), Passcode(SECRET), "s1", "tail", log=logged.append)
    head = SecureLink(relay.join("head"), "8-crossover-clockwork", "s1", "head")
    with pytest.raises(WrongCode, match="wrong pairing code"):
        handshake_both(head, tail, 2)  # the tail's own handshake times out: it raised nothing else
    assert any("a pairing attempt failed" in line and "1 so far" in line for line in logged), logged
    relay.leave("head")
    head = SecureLink(relay.join("head"), SECRET.upper().replace("-", " "), "s1", "head")  # as a person types it
    handshake_both(head, tail)
    head.send(b"after a wrong code")
    assert tail.recv(1) == b"after a wrong code"


def test_the_same_code_in_another_session_does_not_pair():
    relay = Relay()
    tail = SecureLink(relay.join("tail"), SECRET, "two", "tail")
    head = SecureLink(relay.join("head"), SECRET, "one", "head")
    with pytest.raises(WrongCode):
        handshake_both(head, tail, 1)


def test_a_plaintext_peer_is_a_clear_mismatch_before_keys_and_tampering_after():
    relay = Relay()
    head = SecureLink(relay.join("head"), SECRET, "s1", "head")
    relay.join("tail").send(b"SFCH\x01\x06" + bytes(10))  # an unencrypted ERROR from an --insecure tail
    with pytest.raises(secure_link.PlaintextPeer, match="unencrypted"):
        head.handshake(1)
    relay, head, tail = pair()
    relay.deliver("tail", b"SFCH\x01\x04" + bytes(30))
    with pytest.raises(IntegrityError, match="not sealed"):
        tail.recv(1)


def test_a_new_tail_gets_fresh_keys_and_the_old_tails_frames_are_refused():
    relay, head, tail1 = pair()
    head.send(b"to tail one")
    assert tail1.recv(1) == b"to tail one"
    tail1.send(b"from tail one")
    assert head.recv(1) == b"from tail one"
    old = [f for r, f in relay.captured if r == "tail"]  # tail one's key exchange and data frame

    relay.leave("tail")
    with pytest.raises(PeerGone):
        head.recv(1)
    tail2 = SecureLink(relay.join("tail"), SECRET, "s1", "tail")
    head.send(b"to tail two")  # held until the pairing with tail two is keyed
    with pytest.raises(TimeoutError):
        tail2.recv(0.05)
    handshake_both(head, tail2)
    assert tail2.recv(1) == b"to tail two"
    tail2.send(b"from tail two")
    assert head.recv(1) == b"from tail two"  # counters restarted at 0 on both sides

    relay.deliver("head", old[-1])  # tail one's frame #0, replayed into the new pairing
    with pytest.raises(IntegrityError):
        head.recv(1)


def test_an_old_pairing_replayed_before_the_new_peer_arrives_is_refused():
    relay, head, tail1 = pair()
    tail1.send(b"old verdict")
    assert head.recv(1) == b"old verdict"
    old = [f for r, f in relay.captured if r == "tail"]
    relay.leave("tail")
    with pytest.raises(PeerGone):
        head.recv(1)
    for frame in old:  # the relay plays the departed tail back: its key exchange, then its data
        relay.ends["head"].inbox.put(frame)
    with pytest.raises(IntegrityError):
        head.recv(1)


def test_a_second_key_exchange_within_a_pairing_is_refused():
    relay, head, tail = pair()
    other_relay, _, other_tail = pair(session="s1")
    relay.deliver("head", [f for r, f in other_relay.captured if r == "tail"][0])
    with pytest.raises(IntegrityError, match="a pairing message inside a paired session"):
        head.recv(1)


def test_require_secret_policy():
    require_secret("a long enough secret", False)
    require_secret(None, True)
    require_secret(None, False, role="tail")  # a tail makes a code of its own
    with pytest.raises(UserError, match="SFCHAT_CODE"):
        require_secret(None, False)
    with pytest.raises(UserError, match="at least 8"):
        require_secret("short", False)
    with pytest.raises(UserError, match="contradict"):
        require_secret("a long enough secret", True)


# -- fuzzing: whatever the relay delivers, only the link's own error comes out -----------------
@fuzz(150)
@given(st.one_of(st.binary(max_size=200), st.binary(max_size=40).map(lambda b: MAGIC + b)))
def test_arbitrary_bytes_into_a_keyed_link(raw):
    relay, head, tail = pair()
    relay.deliver("tail", raw)
    with pytest.raises(IntegrityError):
        tail.recv(0.2)


@fuzz(150)
@given(st.binary(min_size=0, max_size=300), st.integers(0, 10_000), st.integers(1, 255), st.booleans())
def test_mutated_genuine_frames(payload, position, xor, truncate):
    relay, head, tail = pair()
    relay.tap = lambda sender, frame: [frame[:position % len(frame)] if truncate else
                                       bytes(b ^ (xor if i == position % len(frame) else 0)
                                             for i, b in enumerate(frame))]
    head.send(payload)
    with pytest.raises(IntegrityError):
        tail.recv(0.2)
