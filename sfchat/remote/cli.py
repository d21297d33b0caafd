"""``sfchat --offer-chat`` (the head, where the model is) and ``sfchat --remote`` (the screen, at home).

Contract: ``offer_chat(settings, chat_session, runtime)`` serves ``runtime`` (the head's
``RuntimeWorker``, built by the caller) to one chat client through ``settings.relay`` under
``chat_session`` (default: the head's session with ``-chat`` added), printing, with
timestamps, the chat code and the command to run at home, then one line per thing worth knowing
(a client attached or left, the head's link, loading, ready, a failure), every line through the
process's one log limit (``sfchat.nodelog``, the tail's); returns on Ctrl+C
(``KeyboardInterrupt``) after closing the runtime. A chat session whose slot on the relay is taken
(the name is predictable: anyone with the relay token can take it first) is tried again for
``SLOT_WAIT_S``, the log saying so and how to pick another session; past that a UserError says
the same. The chat code is ``SFCHAT_CHAT_CODE`` when set
(held to the tail's rule, ``pairing.check_code``: a shorter one is a UserError before anything starts),
else made here, and stays the same for the host's life; its resumption secret is kept in the
state directory as the tail keeps its own (``chat-SESSION.resume``). ``remote_chat(settings)``
runs the chat screen against such a head: ``--relay``, ``--session`` (the chat session) and the
relay token as for any head, the chat code from ``SFCHAT_CODE`` or asked on the screen; the
history is this machine's own. Neither imports torch; the chat link is always sealed
(``--insecure`` is refused for it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import platformdirs

from sfchat import UserError
from sfchat.config import Settings, given_params, history_path
from sfchat.events import LinkState, LoadProgress, RuntimeFailed, RuntimeReady
from sfchat.link.pairing import Passcode, check_code
from sfchat.link.relay import RelayLink, SlotTaken, join_while_taken
from sfchat.link.resume import ResumeFile
from sfchat.link.listener import sealed
from sfchat.link.secure import Names
from sfchat.nodelog import node_log
from sfchat.remote.client import RemoteRuntime
from sfchat.remote.host import ChatHost

JOIN_S = 5.0
SLOT_WAIT_S = 30.0  # how long the chat host retries a chat session whose slot is taken
CHAT_HOST = Names("the chat screen", "the chat screen", "this head")  # the chat link's ends, in the host's log


log = node_log("chat")  # joins, pairing attempts and refused frames a stranger causes: the tail's one rate limit


def chat_session_of(s: Settings, chat_session: str | None) -> str:
    from sfchat.config import check

    name = chat_session or f"{s.session[:59]}-chat"
    return check("session", name, "--chat-session")


def chat_resume_path(session: str) -> Path:
    state = os.environ.get("SFCHAT_STATE_DIR") or platformdirs.user_state_dir("sfchat")
    return Path(state).expanduser() / f"chat-{session}.resume"


def chat_code() -> str | None:
    """``SFCHAT_CHAT_CODE`` held to the rule of every pairing code (``pairing.check_code``), or None:
    the host makes one. Whoever pairs as the chat screen drives the head, so a short code is refused."""
    code = os.environ.get("SFCHAT_CHAT_CODE") or None
    if code is not None:
        check_code(code, "SFCHAT_CHAT_CODE", "unset it and --offer-chat makes a code, or set a secret of your own "
                                              "at least that long")
    return code


def another_session(s: Settings) -> str:
    return ("To use another one, start this head with --chat-session NAME (any name of yours, not guessable) "
            f"and the chat screen with sfchat --remote --relay {s.relay} --session NAME")


def home_command(s: Settings, session: str) -> str:
    return f"sfchat --remote --relay {s.relay} --session {session}"


def offer_chat(s: Settings, chat_session: str | None, runtime) -> int:
    if not s.relay or not s.token:
        raise UserError("--offer-chat needs --relay URL and the relay token (SFCHAT_TOKEN): the chat screen on "
                        "your own machine reaches this head through the same relay")
    session = chat_session_of(s, chat_session)
    if session == s.session:
        raise UserError(f"--chat-session must differ from --session ({session!r}): the chat screen has a relay "
                        "session of its own")
    passcode = Passcode(chat_code())
    resumption = ResumeFile(chat_resume_path(session), log)

    def taken(exc: SlotTaken) -> None:
        log(f"{exc}: someone holding the relay token (or another --offer-chat) holds the slot of chat session "
            f"{session!r}; trying again for {SLOT_WAIT_S:.0f} s. {another_session(s)}")

    def join() -> RelayLink:
        try:
            return join_while_taken(lambda: RelayLink(s.relay, s.token, session, "tail"), SLOT_WAIT_S, taken)
        except SlotTaken as exc:
            raise UserError(f"{exc} for {SLOT_WAIT_S:.0f} s: someone else holds the slot of chat session "
                            f"{session!r}. {another_session(s)}") from None

    host = ChatHost(runtime, sealed(join, passcode, session, resumption, log, CHAT_HOST), log, watch=report)
    log(f"chat code: {passcode.code if passcode.generated else '(SFCHAT_CHAT_CODE)'}")
    log("on your own machine (no GPU, no torch: see the README, \"The chat screen from your own terminal\"), with "
        "the relay's token in SFCHAT_TOKEN, run:")
    log(f"    {home_command(s, session)}")
    log("and type the chat code when it asks")
    try:
        host.serve()
    except KeyboardInterrupt:
        host.close()
        log("stopped")
    return 0


def report(event) -> None:
    """What of the head's own events is worth a line in the host's log."""
    match event:
        case LinkState(state="waiting" | "reconnecting" | "connected" | "stalled"):
            log(f"head link {event.state}: {event.detail}")
        case RuntimeReady():
            log(f"ready: {event.model} (draft {event.draft}), {event.mode} mode")
        case RuntimeFailed():
            log(f"{'failed' if event.fatal else 'error'}: {event.message}")
        case LoadProgress() if event.done == event.total and event.total:
            log(f"{event.node} {event.stage}: done")


def remote_chat(s: Settings) -> int:
    from sfchat.ui import run_tui

    if not s.relay:
        raise UserError("--remote needs --relay URL and --session NAME, as the head's `sfchat --offer-chat` printed "
                        "them")
    if not s.token:
        raise UserError("--remote needs the relay token: SFCHAT_TOKEN (or --token T)")
    if s.insecure:
        raise UserError("--remote: the chat link is always sealed end to end; drop --insecure")
    if not all(f is not None and f.isatty() for f in (sys.stdin, sys.stdout, sys.stderr)):
        raise UserError("the chat screen needs a terminal (stdin, stdout and stderr)")
    from sfchat.link.probe import probe

    probe(s.relay, s.token, s.session, "head")
    path = Path(s.history) if s.history else history_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the history directory {path.parent}: {exc}") from None
    params = given_params(s)
    runtime = RemoteRuntime(lambda: RelayLink(s.relay, s.token, s.session, "head"), s.secret, s.session)
    run_tui(runtime, path, params, f"sfchat — the head at {s.relay}, session {s.session} — connecting…", s.system)
    runtime.join(JOIN_S)
    return 0
