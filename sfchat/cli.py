"""Command-line entry point: parse the flags (``sfchat.flags``), dispatch to a mode, word its failure.

Contract: ``run(argv)`` refuses flags the mode would ignore (``flags.refuse_ignored``), then
dispatches to one of seven modes, each its own module, imported only when it runs:

=========================  ===========================================================================
``--remote``               the chat screen driving a head elsewhere (``remote.cli.remote_chat``; no torch)
``--offer-chat``           a head offering its chat to one such screen (``remote.cli.offer_chat``)
``--tail``                 the tail node (``node.tail.serve``)
``--serve``                the OpenAI-compatible endpoint (``serve.main.serve``, options from ``serve.cli``)
``--prompt TEXT``          one reply, printed as it comes (``node.oneshot.one_shot``)
``--prompt TEXT --json``   the same, as exactly one JSON object on stdout
(none of these)            the chat TUI over a head in this process (``tui.chat``)
=========================  ===========================================================================

Every mode but ``--remote`` checks the relay first in relay mode (``node.startup.check_relay``:
its URL, the token's presence, that it answers and takes the token), before anything is asked for
or loaded. Then, from ``node.startup``: the tail checks that the model side is installed (it makes its own
pairing code when none is given); the head's modes (``--offer-chat``, ``--serve``, one-shot,
the chat TUI) choose the models (``with_models``, which checks the model side too) and ask for
the pairing code on a terminal (``ask_secret``), the chat TUI refusing to start without a terminal
before either. ``main(argv)`` runs it and turns a failure into an exit status: a user's mistake is one
``sfchat: error: ...`` line on stderr (``EXIT_USER``), a failed link to the tail one line too
(``EXIT_LINK``), anything else one ``internal error`` line (``EXIT_INTERNAL``; ``SFCHAT_DEBUG=1``
shows its traceback), each text through ``plaintext.plain`` (it may quote a peer or the relay);
Ctrl+C is 130. Torch is imported only by the modes that need it, after parsing.
"""

from __future__ import annotations

import os
import sys

from sfchat import UserError
from sfchat.flags import build_parser, refuse_ignored, settings_from
from sfchat.node.startup import ask_secret, check_relay, need_model_side, with_models
from sfchat.plaintext import plain

EXIT_USER, EXIT_LINK, EXIT_INTERNAL = 2, 3, 4


def run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    s = settings_from(args)
    refuse_ignored(args, s)
    if getattr(args, "remote", False):
        from sfchat.remote.cli import remote_chat

        return remote_chat(s)
    check_relay(s, getattr(args, "tail", False))
    if getattr(args, "offer_chat", False):
        from sfchat.node.worker import RuntimeWorker
        from sfchat.remote.cli import offer_chat

        s = ask_secret(with_models(s), False)
        return offer_chat(s, getattr(args, "chat_session", None), RuntimeWorker(s))
    if getattr(args, "tail", False):
        need_model_side()
        from sfchat.node.tail import serve

        return serve(ask_secret(s, True))
    if getattr(args, "serve", False):
        from sfchat.serve.cli import serve_options

        options = serve_options(args)  # a bad --port is refused before any model is built or loaded
        from sfchat.serve.main import serve

        return serve(ask_secret(with_models(s), False), options)
    from sfchat import tui

    prompt = getattr(args, "prompt", None)
    if prompt is None:
        tui.need_terminal()
    s = ask_secret(with_models(s), False)
    if prompt is not None:
        from sfchat.node.oneshot import one_shot

        return one_shot(s, prompt, getattr(args, "json", False))
    return tui.chat(s)


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except UserError as exc:
        print(f"sfchat: error: {plain(exc)}", file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt:
        print("sfchat: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug or a broken environment: one line, traceback on request
        from sfchat.node.driver import LinkError

        if os.environ.get("SFCHAT_DEBUG"):
            raise
        from sfchat.link import LinkClosed
        from sfchat.link.secure import IntegrityError

        if isinstance(exc, (LinkError, LinkClosed, ConnectionError, IntegrityError)):
            print(f"sfchat: error: link to the tail failed: {plain(exc)}", file=sys.stderr)
            return EXIT_LINK
        print(f"sfchat: internal error: {type(exc).__name__}: {plain(exc)} (set SFCHAT_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
