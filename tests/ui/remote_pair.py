"""What the remote chat tests share: a scripted head behind a chat host, and chat clients paired
with it through an in-process relay."""

from __future__ import annotations

import threading

from sfchat.events import CodeWanted, LinkState, ReplyFinished, ReplyStarted, RoundStats, TokensCommitted
from sfchat.link.pairing import Passcode
from sfchat.link.relay import RelayLink
from sfchat.link.resume import Resumption
from sfchat.link.secure import SecureLink
from sfchat.params import Ask
from sfchat.remote.client import RemoteRuntime
from sfchat.remote.host import ChatHost
from sfchat.tally import Tally

import polling
from pilots import READY, Recording
from relay_process import TOKEN


SESSION = "remote-chat"
CODE = "4-crossover-clockwork"
PIECES = ["Speculative", " decoding", " lets", " a", " **small", " draft", " model**", " propose", " tokens,",
          " and", " the", " big", " model", " checks", " them."]
REPLY = "".join(PIECES)
K = 4
WAIT = 30.0  # a bound on each wait for a state, not a measurement


class ScriptedHead:
    """The head's runtime interface, each round held until the test releases it; honours cancel."""

    def __init__(self, ask_code: bool = False, dropped_turns: int = 0) -> None:
        self.ask_code, self.dropped_turns = ask_code, dropped_turns
        self.codes: list[str] = []
        self.submitted: list[tuple[list[dict], Ask]] = []
        self.new_chats = 0
        self.cancels = 0
        self.finished = threading.Event()
        self._cond = threading.Condition()
        self._rounds = 0  # rounds released and not yet run
        self._cancelled = False
        self.listener = None

    def start(self, listener) -> None:
        self.listener = listener
        threading.Thread(target=self._load, daemon=True).start()

    def _load(self) -> None:
        self.listener(LinkState("waiting", "waiting for a tail"))
        if self.ask_code:
            self.listener(CodeWanted("wrong pairing code: the tail of session 'kaggle' did not accept it"))
            with self._cond:
                self._cond.wait_for(lambda: self.codes, WAIT)
        self.listener(LinkState("connected", "ws://relay"))
        self.listener(READY)

    def release(self, rounds: int = len(PIECES)) -> None:
        with self._cond:
            self._rounds += rounds
            self._cond.notify_all()

    def submit(self, messages, params) -> None:
        self.submitted.append((messages, params))
        self.finished.clear()
        with self._cond:
            self._cancelled = False
        threading.Thread(target=self._generate, daemon=True).start()

    def _generate(self) -> None:
        emit, tally, text, ids = self.listener, Tally(K), "", ()
        emit(ReplyStarted(prompt_tokens=40, reused_tokens=10, prefill_tokens=30, dropped_turns=self.dropped_turns))
        reason = "eos"
        for i, piece in enumerate(PIECES):
            with self._cond:
                self._cond.wait_for(lambda: self._rounds or self._cancelled, WAIT)
                if self._cancelled:
                    reason = "cancelled"
                    break
                self._rounds -= 1
            stats = RoundStats(accepted=i % K, committed=1, draft_ms=5.0, head_ms=3.0, tail_ms=4.0, rtt_ms=80.0,
                               round_ms=100.0)
            text, ids = text + piece, ids + (i,)
            emit(TokensCommitted(piece, (i,), stats, 0.1 * (i + 1)))
            tally.add(stats, 0.1 * (i + 1))
        emit(ReplyFinished(reason, text, ids, 40, **tally.figures()))
        self.finished.set()

    def cancel(self) -> None:
        self.cancels += 1
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def new_chat(self) -> None:
        self.new_chats += 1

    def set_code(self, code: str) -> None:
        with self._cond:
            self.codes.append(code)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()


class Gate:
    """A dial that waits while the test holds its gate shut (``open.clear()``)."""

    def __init__(self, dial) -> None:
        self.dial, self.open = dial, threading.Event()
        self.open.set()

    def __call__(self):
        assert self.open.wait(WAIT), "the test never let this side dial again"
        return self.dial()


class RecordingRemote(Recording, RemoteRuntime):
    """The chat client, keeping a copy of every event it reports."""


def make_pair(url: str, head: ScriptedHead, client_code: str | None = CODE):
    log: list[str] = []
    passcode, kept = Passcode(CODE), Resumption()
    host_dial = Gate(lambda: SecureLink(RelayLink(url, TOKEN, SESSION, "tail"), passcode, SESSION, "tail",
                                        log=log.append, resumption=kept))
    host = ChatHost(head, host_dial, log.append)
    threading.Thread(target=host.serve, daemon=True).start()
    client_dial = Gate(lambda: RelayLink(url, TOKEN, SESSION, "head"))
    client = RecordingRemote(client_dial, client_code, SESSION)
    return host, host_dial, client, client_dial, log


def until(condition) -> bool:
    """Wait (off the app's loop) until ``condition()`` holds, within WAIT."""
    return polling.until(condition, WAIT)


def streamed(client: RecordingRemote) -> str:
    return "".join(e.text for e in client.events if isinstance(e, TokensCommitted))
