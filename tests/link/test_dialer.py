"""The one backoff (``link.backoff``) and the head role's dialer (``link.dialer``): a fake clock for
the waits, fake relay links and a real relay for the pairing."""

from __future__ import annotations

import threading
import time

import pytest
from polling import WAIT, until
from relay_process import TOKEN

from sfchat.events import LinkState
from sfchat.link import LinkClosed
from sfchat.link.backoff import Backoff, GaveUp, redial
from sfchat.link.dialer import Dialer
from sfchat.link.pairing import Passcode
from sfchat.link.relay import RelayLink
from sfchat.link.resume import Resumption
from sfchat.link.secure import SecureLink

CODE = "7-crossover-clockwork"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.paused: list[float] = []

    def __call__(self) -> float:
        return self.now

    def pause(self, delay: float) -> None:
        self.paused.append(delay)
        self.now += delay


# -- the backoff -----------------------------------------------------------------------------------------
def test_the_backoff_doubles_up_to_its_longest_and_starts_over():
    backoff = Backoff(0.5, 4.0)
    assert [backoff.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    backoff.reset()
    assert backoff.next() == 0.5


def test_redial_waits_between_tries_and_gives_up_before_a_try_past_the_deadline():
    clock, tries, told = Clock(), [], []

    def attempt(left):
        tries.append(left)
        clock.now += 0.25  # each try takes a while
        raise TimeoutError(f"try {len(tries)}")

    with pytest.raises(GaveUp) as gave_up:
        redial(attempt, TimeoutError, deadline=clock() + 30.0, on_retry=lambda exc, d: told.append((str(exc), d)),
               pause=clock.pause, clock=clock)
    assert clock.paused == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]  # the next wait, 10 s, would end past the deadline
    assert clock.now <= 1000.0 + 30.0
    assert [d for _, d in told] == clock.paused and told[0][0] == "try 1"
    assert str(gave_up.value.last) == f"try {len(tries)}"
    assert tries[0] == 30.0 and all(left >= 1.0 for left in tries)  # what is left of the deadline, at least 1 s


def test_redial_returns_the_first_success_and_lets_other_errors_and_its_callbacks_stop_it():
    clock = Clock()
    outcomes = iter([TimeoutError("a"), TimeoutError("b"), "linked"])

    def attempt(left):
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert redial(attempt, TimeoutError, pause=clock.pause, clock=clock) == "linked"
    assert clock.paused == [0.5, 1.0]
    with pytest.raises(ValueError):
        redial(lambda left: (_ for _ in ()).throw(ValueError("not retried")), TimeoutError, pause=clock.pause)

    def stop(exc, delay):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        redial(lambda left: (_ for _ in ()).throw(TimeoutError("x")), TimeoutError, on_retry=stop, pause=clock.pause)


# -- the dialer -------------------------------------------------------------------------------------------
class FakeRelayLink:
    """A relay link whose peer comes when the test says (``arrive``), or never."""

    def __init__(self) -> None:
        self.peer = threading.Event()
        self.closed = threading.Event()
        self.waited: list[float | None] = []

    @property
    def peer_present(self) -> bool:
        return self.peer.is_set()

    def wait_peer(self, timeout=None) -> None:
        self.waited.append(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.peer.is_set():
            if self.closed.is_set():
                raise LinkClosed("the link was closed by this side")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("no tail joined")
            time.sleep(0.01)

    def close(self) -> None:
        self.closed.set()


def test_an_insecure_dial_waits_for_the_peer_within_its_deadline_and_says_so():
    link, events = FakeRelayLink(), []
    dialer = Dialer(lambda timeout: link, "s", insecure=True, on_event=events.append, where="ws://relay")
    with pytest.raises(TimeoutError):
        dialer(2.0)
    assert link.waited and link.waited[0] <= 2.0 and link.closed.is_set()
    assert [e.state for e in events] == ["waiting"]
    link = FakeRelayLink()
    link.peer.set()
    assert dialer(2.0) is link
    assert events[-1] == LinkState("connected", "ws://relay (unencrypted: --insecure)")


def test_closing_the_dialer_ends_a_dial_that_waits_for_the_peer_without_a_deadline():
    link = FakeRelayLink()
    dialer = Dialer(lambda timeout: link, "s", CODE)
    failed = []
    thread = threading.Thread(target=lambda: failed.append(pytest.raises(LinkClosed, dialer)), daemon=True)
    thread.start()
    assert until(lambda: link.waited)
    dialer.close()
    thread.join(WAIT)
    assert failed and link.closed.is_set()
    with pytest.raises(LinkClosed, match="dialer was closed"):
        dialer()


def test_a_dialer_pairs_by_its_code_once_then_resumes_without_it(relay_url):
    passcode, kept, events = Passcode(CODE), Resumption(), []
    tail = SecureLink(RelayLink(relay_url, TOKEN, "dialled", "tail"), passcode, "dialled", "tail", resumption=kept)
    served = threading.Event()

    def serve() -> None:  # the tail answers pairings until the test ends
        while not served.is_set():
            try:
                tail.recv(0.1)
            except TimeoutError:
                continue
            except Exception:
                tail.restart()

    threading.Thread(target=serve, daemon=True).start()
    dialer = Dialer(lambda timeout: RelayLink(relay_url, TOKEN, "dialled", "head", connect_timeout=timeout),
                    "dialled", CODE, on_event=events.append, where=relay_url)
    try:
        first = dialer(WAIT)
        assert first.paired_by == "code" and dialer.code is None and dialer.tried
        first.close()
        second = dialer(WAIT)  # no code left: the secret the code pairing left
        assert second.paired_by == "resume"
        second.close()
    finally:
        served.set()
        tail.close()
    assert [e.state for e in events if e.state == "connected"] == ["connected", "connected"]
