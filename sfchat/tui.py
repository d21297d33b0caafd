"""``sfchat`` with no mode flag: the chat screen on a terminal, over a head in this process.

Contract: ``need_terminal()`` is a ``UserError`` (pointing at ``--prompt``) unless stdin, stdout
and stderr are all terminals, since Textual draws on stderr, reads stdin and sizes from stdout.
``chat(settings)`` creates the history's directory (mode 0700: chats are private; a failure is a
``UserError``), starts a ``node.worker.RuntimeWorker`` and runs the Textual app on it
(``ui.run_tui``) with the generation parameters the user chose (``config.given_params``), the
system prompt and a header naming the model and the link while the models load on the runtime
thread. After the UI has quit, the runtime thread is given ``SHUTDOWN_S`` to end (it closes the
link and drops the models); one still busy loading then is abandoned with ``os._exit``, since
interpreter teardown under a live torch thread aborts the process. Returns the exit status, 0.
Importing this module imports neither torch nor Textual: ``chat`` does, when it runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sfchat import UserError
from sfchat.config import Settings, given_params, history_path

SHUTDOWN_S = 10.0  # how long the chat UI's exit waits for the runtime thread


def need_terminal() -> None:
    # all three: Textual draws on stderr (sys.__stderr__), reads stdin and sizes from stdout
    if not all(f is not None and f.isatty() for f in (sys.stdin, sys.stdout, sys.stderr)):
        raise UserError("the chat UI needs a terminal (stdin, stdout and stderr); without one, "
                        "use --prompt TEXT for a one-shot reply")


def chat(s: Settings) -> int:
    """The chat TUI; the models load on the runtime thread while the screen shows progress."""
    from sfchat.node.worker import RuntimeWorker  # torch: imported once the model side is known to be there
    from sfchat.ui import run_tui
    from sfchat.ui.metrics import short_model

    path = Path(s.history) if s.history else history_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # chats are private
    except OSError as exc:
        raise UserError(f"cannot create the history directory {path.parent}: {exc}") from None
    params = given_params(s)
    mode = f"relay {s.relay} session {s.session}" if s.relay else f"direct {s.direct}" if s.direct else "local"
    worker = RuntimeWorker(s)
    run_tui(worker, path, params, f"sfchat — {short_model(s.model)} ({mode}) — loading…", s.system)
    if not worker.join(SHUTDOWN_S):
        print("sfchat: the runtime was still loading; stopped it", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
