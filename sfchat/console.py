"""Lines on stderr for the modes without a screen (one-shot, ``--serve``): download progress.

Contract: ``show_download(event)`` draws a ``LoadProgress`` of a download as one self-rewriting
line when stderr is a terminal, and nothing otherwise. Every string in it that came from
elsewhere (a file name a tail reported) goes through ``plaintext.plain``. Torch-free.
"""

from __future__ import annotations

import sys

from sfchat.events import LoadProgress
from sfchat.plaintext import plain


def show_download(ev) -> None:
    """A one-line download progress bar on stderr, when stderr is a terminal (one-shot mode)."""
    if not (isinstance(ev, LoadProgress) and ev.stage == "download" and ev.detail and ev.total > 1
            and sys.stderr.isatty()):
        return
    width = 30
    filled = width * ev.done // ev.total
    end = "\n" if ev.done >= ev.total else ""
    print(f"\r\x1b[Ksfchat: {plain(ev.node)} downloading {plain(ev.detail)} [{'#' * filled}{'.' * (width - filled)}] "
          f"{ev.done / 2 ** 20:.0f}/{ev.total / 2 ** 20:.0f} MiB", end=end, file=sys.stderr, flush=True)
