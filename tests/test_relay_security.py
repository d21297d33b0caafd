"""Trust no relay, on loopback: what a relay-side capture of an encrypted session holds, what a
meddling relay achieves (an integrity error that ends the session), clear errors for mismatched
secrets, and the relay under load from 50 honest sessions while hostile clients attack it."""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from relay import session as relay_session
from relay.server import RelayConfig, serve
from sfchat import UserError, wire
from sfchat.config import Settings
from sfchat.events import LinkState, ReplyFinished
from sfchat.relay_link import RelayLink
from sfchat.secure_link import DATA, IntegrityError, SecureLink, secure
from test_relay_link import TOKEN, ThreadedRelay
from test_two_machines import ENV, PROMPT

SECRET = "relay-security-test-secret"
TOKENS = tuple(range(151_000, 151_009))  # a verify round's t0 + 8 drafts
PATTERN = b"<known hidden-state pattern 0123456789abcdef>"
HIDDEN = 448
INTEGRITY = "integrity check failed: the relay or the network altered, reordered or replayed a frame"


@pytest.fixture
def relay():
    server = ThreadedRelay()
    yield server
    server.stop()
    server.dispose()


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

    def tapped(session, sender, frame, delay):
        t.frames.append((sender.role, bytes(frame)))
        for out in (t.meddle(sender.role, bytes(frame)) if t.meddle else [frame]):
            forward(session, sender, out, delay)

    monkeypatch.setattr(relay_session.Session, "forward", tapped)
    return t


def verify_frame(rnd: int) -> bytes:
    hidden = (PATTERN * (len(TOKENS) * HIDDEN * 2 // len(PATTERN) + 1))[:len(TOKENS) * HIDDEN * 2]
    return wire.encode(wire.Forward(round=rnd, start_pos=100 + rnd, tokens=TOKENS, hidden=hidden,
                                    dtype=wire.DType.BFLOAT16, hidden_size=HIDDEN, n_draft=len(TOKENS) - 1))


def start_verdict_tail(link, rounds: int) -> threading.Thread:
    """A stand-in tail: answers every verify FORWARD with a VERDICT accepting all drafts."""
    def serve_rounds():
        for _ in range(rounds + 1):
            msg = wire.decode(link.recv(10))
            if isinstance(msg, wire.Forward):
                link.send(wire.encode(wire.Verdict(msg.round, msg.start_pos, len(msg.tokens) - 1, msg.tokens, 7)))
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


# -- whole sessions: tail_node.serve and ChatSession over the relay ---------------------------

def settings(url: str, session: str, model, **changes) -> Settings:
    base = dict(relay=url, token=TOKEN, session=session, secret=SECRET, model=str(model), draft="none", k=0,
                device="cpu", reconnect_timeout=0.0)
    base.update(changes)
    return Settings(**base)


def start_tail(s: Settings) -> tuple[threading.Thread, list]:
    from sfchat.runtime.tail_node import serve as serve_tail

    result = []
    thread = threading.Thread(target=lambda: result.append(serve_tail(s, once=True)), daemon=True)
    thread.start()
    return thread, result


def open_head(s: Settings, events: list):
    from sfchat.runtime.session import ChatSession, connect_relay

    return ChatSession.load(s, events.append, connect_relay(s, events.append, 30))


def reply(session, n: int = 12):
    ids = session.encode([{"role": "user", "content": PROMPT}])
    return [e for e in session.reply(ids, n, wire.Sampling()) if isinstance(e, ReplyFinished)][0], ids


def test_a_full_encrypted_session_matches_local_mode_and_leaks_nothing(zoo, relay, tap, monkeypatch):
    from sfchat.runtime.session import ChatSession

    sealed = []  # every plaintext frame a node sealed, to look for in the capture
    seal = SecureLink.send
    monkeypatch.setattr(SecureLink, "send", lambda self, frame: (sealed.append(bytes(frame)), seal(self, frame))[1])
    model = zoo["qwen2-untied"]
    tail, result = start_tail(settings(relay.url, "full", model))
    head = open_head(settings(relay.url, "full", model, draft=str(zoo["draft"]), k=3), [])
    out, prompt_ids = reply(head)
    head.engine.link.close()
    tail.join(20)
    local = ChatSession.load(Settings(model=str(model), draft=str(zoo["draft"]), k=3, device="cpu"))
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


def test_a_wrong_secret_is_a_clear_error_on_both_sides(zoo, relay, capfd):
    tail, result = start_tail(settings(relay.url, "wrong", zoo["llama-tied"]))
    t0 = time.monotonic()
    with pytest.raises(UserError, match="the tail and head use different session secrets"):
        open_head(settings(relay.url, "wrong", zoo["llama-tied"], secret="not the tail's secret"), [])
    tail.join(20)
    assert time.monotonic() - t0 < 10 and result == [1]
    assert "the head and tail use different session secrets" in capfd.readouterr().err


def test_an_unencrypted_tail_and_an_unencrypted_head_are_named_as_such(zoo, relay):
    tail, _ = start_tail(settings(relay.url, "plain-tail", zoo["llama-tied"], secret=None, insecure=True))
    with pytest.raises(UserError, match="the tail sent an unencrypted frame"):
        open_head(settings(relay.url, "plain-tail", zoo["llama-tied"]), [])
    tail.join(20)

    tail, result = start_tail(settings(relay.url, "plain-head", zoo["llama-tied"]))
    head = RelayLink(relay.url, TOKEN, "plain-head", "head", connect_timeout=5)
    head.wait_peer(5)
    head.send(wire.encode(wire.Control(wire.MsgType.HELLO, {"model": "x"})))
    answer = head.recv(10)
    while answer.startswith(b"SFX1"):  # the tail's own key exchange may come first
        answer = head.recv(10)
    answer = wire.decode(answer)
    assert "this tail encrypts end to end" in answer.data["message"]
    head.close()
    tail.join(20)
    assert result == [1]


# -- the relay's own limits -------------------------------------------------------------------

def run(coro, timeout: float = 60.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


async def dial(port: int, session: str, role: str, token: str = TOKEN, **options):
    options.setdefault("max_size", 8 << 20)
    return await connect(f"ws://127.0.0.1:{port}/session/{session}?role={role}", proxy=None, compression=None,
                         additional_headers={"Authorization": f"Bearer {token}"}, **options)


async def until_event(ws, name: str, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        message = await asyncio.wait_for(ws.recv(), max(deadline - asyncio.get_running_loop().time(), 0.01))
        if isinstance(message, str) and f'"event":"{name}"' in message:
            return


def test_the_shared_buffer_closes_the_slowest_readers_and_frees_their_queues(caplog):
    async def scenario():  # each queue may hold 4 MiB, all of them together only 3
        config = RelayConfig(token=TOKEN, host="127.0.0.1", port=0, max_frame_bytes=1 << 20,
                             max_buffer_bytes=3 << 20)
        async with await serve(config) as relay:
            slow = []
            for i in range(3):
                head = await dial(relay.port, f"slow-{i}", "head")
                tail = await dial(relay.port, f"slow-{i}", "tail", max_queue=1)  # and never reads
                slow.append((head, tail))
            honest_head = await dial(relay.port, "honest", "head")
            honest_tail = await dial(relay.port, "honest", "tail")
            await until_event(honest_head, "peer_joined")
            await until_event(honest_tail, "welcome")
            for _ in range(30):
                for head, _ in slow:
                    await head.send(bytes(1 << 20))
                await honest_head.send(b"still here")
                assert await honest_tail.recv() == b"still here"
                assert relay.budget.used <= relay.budget.limit
            for head, _ in slow:
                await until_event(head, "peer_left")
            for head, tail in slow:
                await head.close()
                tail.transport.abort()  # it paused reading: a polite close would wait for its timeout
            await honest_head.send(b"after the flood")
            assert await honest_tail.recv() == b"after the flood"
            await honest_head.close()
            await honest_tail.close()
            await asyncio.sleep(0.2)
            assert relay.budget.used == 0 and not relay.budget.peers
    run(scenario())
    assert caplog.text.count("relay buffer full: this side reads too slowly; closing it") == 3


def test_the_connection_limit_refuses_with_503():
    async def scenario():
        async with await serve(RelayConfig(token=TOKEN, host="127.0.0.1", port=0, max_connections=3)) as relay:
            held = [await dial(relay.port, f"c{i}", "head") for i in range(3)]
            with pytest.raises(InvalidStatus) as refused:
                await dial(relay.port, "c9", "head")
            assert refused.value.response.status_code == 503 and b"3 connections" in refused.value.response.body
            await held[0].close()
            await asyncio.sleep(0.1)
            held[0] = await dial(relay.port, "c9", "head")  # room again
            for ws in held:
                await ws.close()
    run(scenario())


def vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


SESSIONS, ROUNDS, FORWARD_BYTES, PREFILL = 50, 60, 9 * 3584 * 2, (4, 256 << 10)


async def honest(port: int, i: int, paired: asyncio.Event, ready: list) -> int:
    """One head/tail pair doing what sfchat does: a prefill burst, then verify rounds."""
    name = f"honest-{i}"
    head = await dial(port, name, "head")
    tail = await dial(port, name, "tail")
    await until_event(head, "peer_joined")
    ready.append(name)
    if len(ready) == SESSIONS:
        paired.set()
    rng = random.Random(i)

    async def tail_side():
        for _ in range(ROUNDS + PREFILL[0]):
            frame = await tail.recv()
            while isinstance(frame, str):
                frame = await tail.recv()
            if frame[:1] == b"F":
                await tail.send(b"V" + hashlib.sha256(frame).digest())

    async def head_side():
        for _ in range(PREFILL[0]):
            await head.send(b"P" + rng.randbytes(PREFILL[1]))
        for _ in range(ROUNDS):
            frame = b"F" + rng.randbytes(FORWARD_BYTES)
            await head.send(frame)
            assert await head.recv() == b"V" + hashlib.sha256(frame).digest()

    await asyncio.gather(tail_side(), head_side())
    await head.close()
    await tail.close()
    return ROUNDS


async def outcome(coro) -> str:
    """How a hostile attempt ended: an HTTP status or a close code."""
    try:
        result = await coro
        return result if isinstance(result, str) else type(result).__name__
    except InvalidStatus as exc:
        return f"http {exc.response.status_code}"
    except ConnectionClosed as exc:
        return f"close {exc.rcvd.code if exc.rcvd else 1006}"


async def hostile(port: int, paired: asyncio.Event) -> dict:
    kept = []  # connections that only need to exist
    async def bad_token(i):
        await dial(port, f"x{i}", "head", token=f"guess-{i}")

    async def text(i):
        ws = await dial(port, f"text-{i}", "head")
        await ws.send("<script>")
        while True:
            await ws.recv()

    async def oversize(i):
        ws = await dial(port, f"big-{i}", "head")
        await ws.send(bytes(2 << 20))
        while True:
            await ws.recv()

    async def garbage(i):
        ws = await dial(port, f"void-{i}", "tail")
        for _ in range(50):
            await ws.send(random.randbytes(random.randrange(1, 4096)))
        await until_event(ws, "dropped")
        await ws.close()
        return "dropped"

    async def flood(i):
        head = await dial(port, f"flood-{i}", "head")
        kept.append(await dial(port, f"flood-{i}", "tail"))
        while True:
            await head.send(b"!" * 64)

    async def slow_reader(i):
        head = await dial(port, f"slow-{i}", "head")
        kept.append(await dial(port, f"slow-{i}", "tail", max_queue=1))  # never reads
        for _ in range(40):
            await head.send(bytes(1 << 20))
        await until_event(head, "peer_left")
        return "peer closed"

    async def idle(i):
        ws = await dial(port, f"idle-{i}", "head")
        while True:
            await ws.recv()

    async def raw_tcp(i):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(random.randbytes(4096) + b"\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 15)
        writer.close()
        return "http " + answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "eof"

    async def steal(i):
        await paired.wait()
        await dial(port, f"honest-{i}", "tail")
        return "joined"

    kinds = {"bad token": (bad_token, 200), "text": (text, 20), "oversize": (oversize, 10),
             "garbage": (garbage, 10), "flood": (flood, 5), "slow reader": (slow_reader, 5), "idle": (idle, 5),
             "raw tcp": (raw_tcp, 10), "slot stealer": (steal, 10)}
    results = {}
    for kind, (attack, n) in kinds.items():
        results[kind] = asyncio.gather(*(outcome(attack(i)) for i in range(n)))
    return {kind: sorted(set(await task)) for kind, task in results.items()}


def test_fifty_sessions_complete_while_hostile_clients_attack_and_memory_stays_bounded(tmp_path):
    log = tmp_path / "relay.log"
    with open(log, "w") as err:
        relay = subprocess.Popen(
            [sys.executable, "-m", "relay.server", "--host", "127.0.0.1", "--port", "0", "--token", TOKEN,
             "--max-frame-mb", "1", "--max-connections", "200", "--max-sessions", "200", "--max-frames-per-s", "1000",
             "--max-mb-per-s", "64", "--max-buffer-mb", "64", "--idle-timeout", "0.15"],
            stdout=subprocess.PIPE, stderr=err, text=True, env=ENV)
    try:
        port = int(re.search(r"listening on ws://[^:]+:(\d+)", relay.stdout.readline())[1])
        while not relay.stdout.readline().lstrip().startswith("tail:"):
            pass
        time.sleep(0.5)
        before = vm_kib(relay.pid, "VmRSS")
        peak = [before]

        async def scenario():
            paired, ready = asyncio.Event(), []
            stop = asyncio.Event()

            async def sample():
                while not stop.is_set():
                    peak.append(vm_kib(relay.pid, "VmRSS"))
                    await asyncio.sleep(0.1)

            sampler = asyncio.create_task(sample())
            t0 = time.perf_counter()
            attacks = asyncio.create_task(hostile(port, paired))
            done = await asyncio.gather(*(honest(port, i, paired, ready) for i in range(SESSIONS)))
            honest_s = time.perf_counter() - t0
            outcomes = await attacks
            stop.set()
            await sampler
            return done, honest_s, outcomes

        done, honest_s, outcomes = run(scenario(), timeout=90)
        after, hwm = vm_kib(relay.pid, "VmRSS"), vm_kib(relay.pid, "VmHWM")
    finally:
        relay.terminate()
        relay.wait(10)
    text = log.read_text()
    frames = SESSIONS * (2 * ROUNDS + PREFILL[0])
    volume = SESSIONS * (ROUNDS * (FORWARD_BYTES + 34) + PREFILL[0] * PREFILL[1]) / 2 ** 20
    print(f"\n{SESSIONS} honest sessions, {frames} frames ({volume:.0f} MiB) in {honest_s:.1f} s; relay RSS "
          f"{before / 1024:.0f} MiB before, peak {max(peak) / 1024:.0f} MiB (VmHWM {hwm / 1024:.0f}), "
          f"{after / 1024:.0f} MiB after; hostile outcomes {outcomes}")
    assert done == [ROUNDS] * SESSIONS
    assert outcomes["bad token"] == ["http 401"]
    assert outcomes["text"] == ["close 1003"] and outcomes["oversize"] == ["close 1009"]
    assert outcomes["garbage"] == ["dropped"] and outcomes["slow reader"] == ["peer closed"]
    assert outcomes["flood"] == ["close 1008"] and outcomes["idle"] == ["close 4408"]
    assert outcomes["slot stealer"] == ["http 409"]
    assert set(outcomes["raw tcp"]) <= {"http 400", "eof"}
    assert hwm - before < 256 << 10, "relay memory grew by more than 256 MiB"
    assert text.count("bad or missing token") == 1  # 200 refusals, one line
    assert text.count("exceeded") == 1 and text.count("sent nothing for") == 1
    assert "Traceback" not in text
