"""Command-line entry point: dispatch to a mode (the flags themselves: ``sfchat.flags``).

Modes: one-shot (``--prompt``; ``--json`` prints exactly one JSON object), the tail node
(``--tail``), and otherwise the chat TUI. In relay mode the relay is checked first (``check_relay``:
its URL, the token's presence, that it answers and takes the token), before anything is asked
for or loaded. User mistakes become one ``sfchat: error: ...`` line
on stderr and a non-zero exit (its text through ``sfchat.plaintext.plain``: it may quote a
peer or the relay), never a traceback (set ``SFCHAT_DEBUG=1`` to see one for an
unexpected failure). Torch is imported only by the modes that need it, after parsing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from sfchat import UserError
from sfchat.config import CPU_MODEL, GPU_MODEL, Settings, given_params, machine_defaults
from sfchat.console import show_download
from sfchat.flags import build_parser, refuse_ignored, settings_from
from sfchat.plaintext import plain, printable

EXIT_USER, EXIT_LINK, EXIT_INTERNAL = 2, 3, 4
SHUTDOWN_S = 10.0  # how long the chat UI's exit waits for the runtime thread

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
    """Relay mode, head: ask for the pairing code on a terminal when neither flag nor env gave one
    (without a terminal, the link refuses with a message saying how to set it). A tail without
    a code makes one."""
    if s.relay and s.insecure:
        print("sfchat: warning: --insecure: frames cross the relay unencrypted; whoever runs the relay "
              "can read and alter the chat", file=sys.stderr)
    if not s.relay or s.secret or s.insecure or tail or not sys.stdin.isatty():
        return s
    import getpass

    try:
        secret = getpass.getpass("sfchat: pairing code (printed by `sfchat --tail`; the relay never sees it): ")
    except EOFError:
        secret = ""
    return dataclasses.replace(s, secret=secret or None)


def one_shot(s: Settings, prompt: str, as_json: bool) -> int:
    from sfchat.events import LinkState, ReplyFinished, TokensCommitted
    from sfchat.node.connect import HeadDialer
    from sfchat.node.head import Head

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
        raise UserError(f"no tail joined session {s.session!r} at {s.relay} within {s.reconnect_timeout:g} s "
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
            "mode": info.mode,
        }
        print(json.dumps(out))
    else:
        print()
        per_round = f"{final.tokens_per_round:.2f} tokens/round, " if info.draft != "none" else ""
        print(f"[{len(final.token_ids)} tokens, {final.rounds} rounds, {per_round}"
              f"{final.tps:.1f} tok/s, ttft {final.ttft_s:.2f} s]", file=sys.stderr)
    return 0


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
    if chosen.relay:
        from sfchat.node.head import open_sources

        open_sources(chosen, show_download)
    return chosen


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
        options = serve_options(args)  # a bad --port is refused before any model is built or loaded
        return serve_http(ask_secret(with_models(s), False), options)
    prompt = getattr(args, "prompt", None)
    if prompt is None:
        need_terminal()
    s = ask_secret(with_models(s), False)
    if prompt is not None:
        return one_shot(s, prompt, getattr(args, "json", False))
    return chat(s)


def serve_options(args: argparse.Namespace):
    from sfchat.serve.app import ServeOptions
    from sfchat.serve.main import api_key_from

    options = ServeOptions(host=getattr(args, "host", "127.0.0.1"), port=getattr(args, "port", 8000),
                           api_key=api_key_from(getattr(args, "api_key", None)),
                           max_queue=getattr(args, "max_queue", 16))
    if not 0 <= options.port <= 65535:
        raise UserError(f"--port must be 0..65535, not {options.port}")
    if options.max_queue < 1:
        raise UserError(f"--max-queue must be at least 1, not {options.max_queue}")
    return options


def serve_http(s: Settings, options) -> int:
    """``--serve``: the OpenAI-compatible endpoint (sfchat/serve)."""
    from sfchat.serve.main import serve

    return serve(s, options)


_started = None  # the server start_server last started in this process


def start_server(argv: list[str] = (), load_timeout: float | None = None):
    """``sfchat --serve ARGV`` inside this process (a notebook's kernel), in the background: the
    flags and the environment (SFCHAT_RELAY, SFCHAT_TOKEN, SFCHAT_CODE, ...) are read as the
    command line reads them, the relay is checked, the models load (progress on stderr), and the
    running ``sfchat.serve.main.Server`` is returned once it answers: ``url``, ``set_code(code)``
    (a new pairing code without a restart), ``close()``. A server this function started before in
    this process is closed first, its models dropped and its port freed, so that running the
    cell again replaces the server instead of failing beside it. Loading past ``load_timeout``
    seconds (None: no limit) fails; errors are ``UserError``s."""
    global _started
    from sfchat.serve.main import Server, exposure_warning, report

    argv = [a for a in argv if a != "--serve"]
    args = build_parser().parse_args(argv)
    s = settings_from(args)
    options = serve_options(args)
    if _started is not None:
        previous, _started = _started, None
        previous.close()
    check_relay(s)
    if warning := exposure_warning(options):
        print(warning, file=sys.stderr, flush=True)
    server = Server(ask_secret(with_models(s), False), options, on_event=report)
    try:
        server.start(load_timeout=load_timeout)
    except BaseException:
        server.close()
        raise
    _started = server
    print(f"sfchat: serving at {server.url}/v1 (in this process; server.set_code(CODE) takes a new pairing "
          f"code, server.close() stops it)", file=sys.stderr, flush=True)
    return server


def need_terminal() -> None:
    # all three: Textual draws on stderr (sys.__stderr__), reads stdin and sizes from stdout
    if not all(f is not None and f.isatty() for f in (sys.stdin, sys.stdout, sys.stderr)):
        raise UserError("the chat UI needs a terminal (stdin, stdout and stderr); without one, "
                        "use --prompt TEXT for a one-shot reply")


def chat(s: Settings) -> int:
    """The chat TUI; the models load on the runtime thread while the screen shows progress.

    After the UI has quit, the runtime thread is given ``SHUTDOWN_S`` to end (it closes the link
    and drops the models); one still busy loading then is abandoned with ``os._exit``, since
    interpreter teardown under a live torch thread aborts the process."""
    from sfchat.config import history_path
    from sfchat.node.worker import RuntimeWorker
    from sfchat.ui import run_tui
    from sfchat.ui.metrics import short_model

    path = Path(s.history) if s.history else history_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # chats are private
    except OSError as exc:
        raise UserError(f"cannot create the history directory {path.parent}: {exc}") from None
    params = given_params(s)
    mode = f"relay {s.relay} session {s.session}" if s.relay else "local"
    worker = RuntimeWorker(s)
    run_tui(worker, path, params, f"sfchat — {short_model(s.model)} ({mode}) — loading…", s.system)
    if not worker.join(SHUTDOWN_S):
        print("sfchat: the runtime was still loading; stopped it", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


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
