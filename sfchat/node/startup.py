"""What a mode settles before it loads a model or pairs: the relay, the model side, the models, the code.

Contract
--------
``check_relay(settings, tail=False)``: in relay mode, what can be checked before anything is asked
for or loaded (the relay URL, the token's presence, that the relay answers and takes the token:
``link.probe``), each failure one ``UserError`` line that says what to check; nothing without a
relay. ``ask_secret(settings, tail=False)``: with two machines (``--relay``, ``--direct``,
``--listen``), a warning on stderr under ``--insecure``; a head without a pairing code (flag or environment) is asked for it on a
terminal (without one, the link refuses later with a message saying how to set it); a tail
without one makes its own, so nothing is asked. ``need_model_side()``: a ``UserError`` of one
line when torch or transformers is not installed (``sfchat --remote`` needs neither).
``with_models(settings)``: the models to run, the user's or this machine's defaults
(``config.machine_defaults``); the CPU default model is built on first use and said so in one
line on stderr; a head of two machines opens the models' configs and tokenizers here (``head.open_sources``)
so that a refusal comes before it asks for a code or pairs.

Used by the modes of ``sfchat.cli`` that run a model and by ``serve.cli.start_server``. Imports
torch, the link probe and the models only inside the functions that need them.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from sfchat import UserError
from sfchat.config import CPU_MODEL, GPU_MODEL, Settings, machine_defaults
from sfchat.console import show_download


def check_relay(s: Settings, tail: bool = False) -> None:
    """Relay mode: what can be checked before anything is asked for or loaded (each failure one
    line that says what to check)."""
    if not s.relay:
        return
    from sfchat.link.probe import check_url, probe

    check_url(s.relay)
    if not s.token:
        raise UserError(f"{'--tail' if tail else '--relay'} needs the relay token that sfchat-relay printed: "
                        "SFCHAT_TOKEN (or --token T)")
    probe(s.relay, s.token, s.session, "tail" if tail else "head")


def ask_secret(s: Settings, tail: bool = False) -> Settings:
    """Two machines (``--relay`` or ``--direct``), head: ask for the pairing code on a terminal when neither flag nor env gave one
    (without a terminal, the link refuses with a message saying how to set it). A tail without
    a code makes one."""
    if (s.relay or s.direct or s.listen) and s.insecure:
        print("sfchat: warning: --insecure: frames cross the relay (or the direct link) unencrypted; whoever runs "
              "the relay or sits on the path can read and alter the chat", file=sys.stderr)
    if not (s.relay or s.direct) or s.secret or s.insecure or tail or not sys.stdin.isatty():
        return s
    import getpass

    try:
        secret = getpass.getpass("sfchat: pairing code (printed by `sfchat --tail`; the relay never sees it): ")
    except EOFError:
        secret = ""
    return dataclasses.replace(s, secret=secret or None)


def need_model_side() -> None:
    """A head, a tail or a server runs a model: without the ``[model]`` extra that is one line, not a traceback."""
    import importlib.util

    try:
        found = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
    except ImportError:
        found = False
    if not found:
        raise UserError("this sfchat has no model side installed (torch, transformers): pip install 'sfchat[model]' "
                        "(see the README); `sfchat --remote` drives a head that runs elsewhere without them")


def with_models(s: Settings) -> Settings:
    """The models to run: the user's, else this machine's defaults; the CPU default model is
    built on first use, and said so in one line. A relay head checks them here, before it asks
    for a code or pairs (``head.open_sources``: a default draft of another tokenizer is refused
    now, not inside the chat screen once the tail is paired)."""
    need_model_side()
    import torch

    chosen = machine_defaults(s, torch.cuda.is_available())
    if s.model is None and chosen.model != GPU_MODEL:
        from sfchat.model.convert import ensure_smollm2

        ensure_smollm2(Path(chosen.model))
        draft = "without a draft (the fastest on a CPU)" if chosen.draft == "none" else f"draft {chosen.draft}"
        print(f"sfchat: no CUDA GPU and no --model: using {CPU_MODEL}, a small model to try sfchat out with (its "
              f"answers are a toy's), {draft}; --model picks another", file=sys.stderr)
    if chosen.relay or chosen.direct:
        from sfchat.node.head import open_sources

        open_sources(chosen, show_download)
    return chosen
