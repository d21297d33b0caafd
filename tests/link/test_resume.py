"""Resumption (sfchat.link.resume and the RESUME frames of sfchat.link.pairer) over the meddling
in-memory relay of sealed_pairs: a code pairing leaves both sides one secret, a restarted
tail that kept it pairs again with no code, a stranger still needs the code, a capture of a
resumption holds nothing to test offline, and the tail's file is private and written whole."""

from __future__ import annotations

import os
import stat

import pytest

from sfchat.link.pairer import DATA, OPEN, RESUME
from sfchat.link.pairing import BURST, SECRET_BYTES, Passcode
from sfchat.link.resume import Resumption, ResumeFile
from sfchat.link.secure import SecureLink, WrongCode

from sealed_pairs import SECRET, Relay, handshake_both, shared_windows

RESTARTED_CODE = "9-restarted-tail"  # what a restarted tail prints: the head never typed it


def tail_end(relay: Relay, resumption: Resumption, code: str = SECRET, session: str = "s1", log=None) -> SecureLink:
    return SecureLink(relay.join("tail"), Passcode(code), session, "tail", log=log, resumption=resumption)


def head_end(relay: Relay, resumption: Resumption, code: str = SECRET, session: str = "s1") -> SecureLink:
    return SecureLink(relay.join("head"), code, session, "head", resumption=resumption)


def first_pairing(tmp_path, relay: Relay | None = None):
    """A code pairing whose head sent one frame: (relay, the head's Resumption, the tail's ResumeFile)."""
    relay = relay or Relay()
    mine, kept = Resumption(), ResumeFile(tmp_path / "state" / "tail-s1.resume")
    head, tail = head_end(relay, mine), tail_end(relay, kept)
    handshake_both(head, tail)
    head.send(b"the reply so far")
    assert tail.recv(1) == b"the reply so far"
    return relay, mine, kept


def sent(relay: Relay, role: str, kind: int) -> list[bytes]:
    return [f for r, f in relay.captured if r == role and f[4] == kind]


def test_a_restarted_tail_that_kept_its_file_pairs_again_with_no_code_and_fresh_keys(tmp_path):
    relay, mine, kept = first_pairing(tmp_path)
    assert mine.secret is not None and len(mine.secret) == SECRET_BYTES and mine.secret == kept.secret
    assert stat.S_IMODE(os.stat(kept.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(kept.path.parent).st_mode) == 0o700
    (first,) = sent(relay, "head", DATA)

    relay.leave("tail")  # the notebook restarts: a new process, a new code, the same state directory
    restarted = ResumeFile(kept.path)
    assert restarted.secret == mine.secret
    logged = []
    tail = tail_end(relay, restarted, code=RESTARTED_CODE, log=logged.append)
    relay.leave("head")
    head = head_end(relay, mine)  # the head dials again with what it has: the old code, the secret
    handshake_both(head, tail)
    head.send(b"the reply so far")
    assert tail.recv(1) == b"the reply so far"
    assert len(sent(relay, "head", RESUME)) == 1 and len(sent(relay, "head", OPEN)) == 1  # the first pairing's
    assert any("resumed its pairing" in line for line in logged), logged
    (_, again) = sent(relay, "head", DATA)
    assert again[:13] == first[:13] and again[13:] != first[13:]  # counter 0 both times, under new keys
    assert restarted.secret == mine.secret  # a resumption leaves the secret as it was


def test_a_stranger_with_a_secret_of_its_own_still_needs_the_code(tmp_path):
    relay, mine, kept = first_pairing(tmp_path)
    relay.leave("head")
    relay.leave("tail")
    logged = []
    tail = tail_end(relay, ResumeFile(kept.path), log=logged.append)
    stranger = head_end(relay, Resumption(os.urandom(SECRET_BYTES)), code="4-a-guess")
    with pytest.raises(WrongCode, match="wrong pairing code"):
        handshake_both(stranger, tail, 2)  # the resumption fails, then the guess
    assert not tail.keyed and any("a resumption attempt failed" in line for line in logged), logged
    assert ResumeFile(kept.path).secret == mine.secret  # the stranger changed nothing
    relay.leave("head")
    theirs = Resumption(os.urandom(SECRET_BYTES))
    knows_the_code = head_end(relay, theirs)
    handshake_both(knows_the_code, tail)  # a failed resumption falls back to the code
    assert ResumeFile(kept.path).secret == theirs.secret != mine.secret  # the code pairing made a new one


def test_a_tail_without_a_secret_refuses_the_resumption_and_the_head_falls_back_to_its_code(tmp_path):
    relay = Relay()
    mine = Resumption(os.urandom(SECRET_BYTES))
    kept = ResumeFile(tmp_path / "fresh")
    assert kept.secret is None
    handshake_both(head_end(relay, mine), tail_end(relay, kept))
    assert len(sent(relay, "head", RESUME)) == 1 and len(sent(relay, "head", OPEN)) == 1
    assert kept.secret == mine.secret


def test_a_secret_does_not_resume_under_another_session_name(tmp_path):
    relay, mine, kept = first_pairing(tmp_path)
    for role in ("head", "tail"):
        relay.leave(role)
    tail = tail_end(relay, Resumption(kept.secret), session="s2")  # the same secret, another name
    with pytest.raises(WrongCode):
        handshake_both(head_end(relay, mine, session="s1"), tail, 1)


def test_resumption_takes_no_turn_of_the_codes_budget(tmp_path):
    relay, mine, kept = first_pairing(tmp_path)
    passcode = Passcode(RESTARTED_CODE)
    for _ in range(BURST):
        passcode.spend()  # a guesser has just used every turn
    for _ in range(3):
        for role in ("head", "tail"):
            relay.leave(role)
        logged = []
        tail = SecureLink(relay.join("tail"), passcode, "s1", "tail", log=logged.append, resumption=kept)
        handshake_both(head_end(relay, mine), tail, 2)
        assert not any("for its turn" in line for line in logged), logged


def test_a_capture_of_a_resumption_holds_nothing_to_test_offline(tmp_path):
    """Whatever two resumptions with one secret share, a resumption with another secret shares too:
    framing. The secret itself never crosses the relay."""
    relay, mine, kept = first_pairing(tmp_path)
    captures = []
    for secret in (mine.secret, mine.secret, os.urandom(SECRET_BYTES)):
        relay = Relay()
        handshake_both(head_end(relay, Resumption(secret)), tail_end(relay, Resumption(secret)))
        assert len(sent(relay, "head", RESUME)) == 1 and not sent(relay, "head", OPEN)
        captures.append([f for _, f in relay.captured])
    same, again, other = captures
    constant = set(shared_windows(same, other))
    assert [w for w in shared_windows(same, again) if w not in constant] == []
    assert all(mine.secret[i:i + 8] not in b"".join(same) for i in range(SECRET_BYTES - 7))


def test_the_tails_file_is_not_used_when_others_may_read_it_or_it_is_malformed(tmp_path):
    logged = []
    path = tmp_path / "tail-s1.resume"
    ResumeFile(path).keep(b"\x07" * SECRET_BYTES)
    assert ResumeFile(path).secret == b"\x07" * SECRET_BYTES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tail-s1.resume"]  # no temporary file left
    os.chmod(path, 0o644)
    assert ResumeFile(path, logged.append).secret is None and "chmod 600" in logged[-1]
    os.chmod(path, 0o600)
    path.write_bytes(path.read_bytes()[:-3])
    assert ResumeFile(path, logged.append).secret is None and "malformed" in logged[-1]
    link = tmp_path / "link.resume"
    link.symlink_to(path)
    assert ResumeFile(link, logged.append).secret is None and "not using" in logged[-1]
    blocked = tmp_path / "no-dir"
    blocked.write_text("a file where the directory should be")
    kept = ResumeFile(blocked / "tail-s1.resume", logged.append)
    kept.keep(b"\x01" * SECRET_BYTES)
    assert kept.secret == b"\x01" * SECRET_BYTES and "cannot keep the resumption secret" in logged[-1]
