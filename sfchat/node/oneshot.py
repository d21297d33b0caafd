"""``sfchat --prompt TEXT``: one reply to one prompt, printed as it comes, then its figures.

Contract: ``one_shot(settings, prompt, as_json)`` dials the tail when ``settings.relay`` or ``settings.direct``
is set (``connect.HeadDialer``; no tail within ``--reconnect-timeout`` is a ``UserError``), opens a
``head.Head``, warns on stderr of what the model's own sampling defaults left out, and asks it for
one reply to ``prompt`` with the head's sampling (flags, config, the model's defaults). Without
``as_json`` the reply's text goes to stdout as it is committed (``plaintext.printable`` on a
terminal: every token is the tail's choice, so no escape reaches it) and one line of figures to
stderr; with it, stdout gets exactly one JSON object (the text, the token ids, the figures and the
runtime's model, draft, split, dtypes, device and mode, and ``via``: how the last dial reached the
tail, "direct", "relay", or "memory" in local mode). Link trouble and its end are one line
each on stderr in either case, download progress too (``console.show_download``); a reply cut by
a full context window says so on stderr. Returns the exit status, 0.
"""

from __future__ import annotations

import json
import sys

from sfchat import UserError
from sfchat.config import Settings
from sfchat.console import show_download
from sfchat.events import LinkState, ReplyFinished, TokensCommitted
from sfchat.node.connect import HeadDialer
from sfchat.node.head import Head
from sfchat.plaintext import plain, printable


def one_shot(s: Settings, prompt: str, as_json: bool) -> int:
    troubled = []

    def report(ev):  # link trouble (and its end) is worth a line on stderr even in --json mode
        show_download(ev)
        if not isinstance(ev, LinkState):
            return
        if ev.state in ("waiting", "reconnecting", "stalled"):
            troubled.append(ev.state)
        elif not (ev.state == "connected" and troubled):
            return
        print(f"sfchat: link {ev.state}: {plain(ev.detail)}", file=sys.stderr, flush=True)

    dial = HeadDialer(s, report)
    try:
        link = dial(s.reconnect_timeout)  # nobody serves the session: bounded, as every later wait is
    except TimeoutError:
        raise UserError(f"no tail joined session {s.session!r} at {s.relay or s.direct} within {s.reconnect_timeout:g} s "
                        "(--reconnect-timeout): is `sfchat --tail` running with this --session?") from None
    head = Head.open(s, report, link, redial=dial)
    for note in head.defaults.notes:
        print(f"sfchat: warning: {plain(note)}", file=sys.stderr)
    sampling = head.sampling()
    final = None
    shown = printable if sys.stdout.isatty() else str  # every token is the tail's choice: no escapes on a terminal
    for ev in head.ask([{"role": "user", "content": prompt}], s.max_new_tokens, sampling):
        if isinstance(ev, TokensCommitted) and not as_json and ev.text:
            sys.stdout.write(shown(ev.text))
            sys.stdout.flush()
        elif isinstance(ev, ReplyFinished):
            final = ev
    info = head.info
    if final.finish_reason == "context":
        print(f"sfchat: the context window of {info.max_context} tokens is full; the reply was cut there",
              file=sys.stderr)
    if as_json:
        out = {
            "text": final.text, "token_ids": list(final.token_ids), **final.figures(),
            "model": info.model, "draft": info.draft, "k": info.k, "split": info.split,
            "n_layers": info.n_layers, "dtype": info.dtype, "tail_dtype": info.tail_dtype or info.dtype,
            "quant": info.quant, "device": info.device,
            "mode": info.mode, "via": dial.via if link is not None else "memory",
        }
        print(json.dumps(out))
    else:
        print()
        per_round = f"{final.tokens_per_round:.2f} tokens/round, " if info.draft != "none" else ""
        print(f"[{len(final.token_ids)} tokens, {final.rounds} rounds, {per_round}"
              f"{final.tps:.1f} tok/s, ttft {final.ttft_s:.2f} s]", file=sys.stderr)
    return 0
