"""Command-line entry point: argument parsing and dispatch.

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

from sfchat import UserError, __version__
from sfchat.config import (AUTO_K, AUTO_TREE_BUDGET, CPU_DRAFT, CPU_MODEL, GPU_DRAFT, GPU_MODEL, Settings,
                           machine_defaults, merged)
from sfchat.console import show_download
from sfchat.plaintext import plain, printable

EXIT_USER, EXIT_LINK, EXIT_INTERNAL = 2, 3, 4
SHUTDOWN_S = 10.0  # how long the chat UI's exit waits for the runtime thread

FLAG_FIELDS = {  # flag dest -> Settings field
    "model": "model", "draft": "draft", "revision": "revision", "draft_revision": "draft_revision",
    "k": "k", "tree_budget": "tree_budget", "split": "split", "device": "device", "draft_device": "draft_device", "dtype": "dtype",
    "max_context": "max_context", "max_new_tokens": "max_new_tokens", "temperature": "temperature",
    "top_k": "top_k", "top_p": "top_p", "seed": "seed", "system": "system", "relay": "relay",
    "token": "token", "session": "session", "history": "history", "round_timeout": "round_timeout",
    "reconnect_timeout": "reconnect_timeout", "secret": "secret",
    "load_in_4bit": "load_in_4bit", "models_dir": "models_dir", "draft_load_in_4bit": "draft_load_in_4bit",
    "max_in_flight": "max_in_flight", "draft_ahead": "draft_ahead",
}


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = argparse.ArgumentParser(
        prog="sfchat", argument_default=argparse.SUPPRESS,
        description="Chat with one language model split across two machines, with speculative decoding.",
        epilog="Settings may also come from the TOML file (see --config) and SFCHAT_TOKEN / SFCHAT_RELAY / "
               "SFCHAT_SESSION / SFCHAT_CODE; flags win.")
    p.add_argument("--version", action="version", version=f"sfchat {__version__}")
    g = p.add_argument_group("models")
    g.add_argument("--model", help=f"target model: hub id or local directory (or SFCHAT_MODEL; default {GPU_MODEL} "
                                   f"with a CUDA GPU or with --relay, else {CPU_MODEL}, a small model to try sfchat "
                                   "out with, built locally on first use)")
    g.add_argument("--draft", help=f"draft model, or 'none' for no speculation (default {GPU_DRAFT}; "
                                   f"{CPU_DRAFT} with the CPU default model)")
    g.add_argument("--revision", help="hub revision of the target model")
    g.add_argument("--draft-revision", help="hub revision of the draft model")
    g.add_argument("--k", metavar="K|auto",
                   help=f"the draft's expansion steps per frame: how much deeper one frame can reach (a chain of K "
                        f"drafts without a tree); auto (default): {AUTO_K}")
    g.add_argument("--tree-budget", metavar="N|auto",
                   help="drafts per frame, grown best-first over the live speculation tree (0 = a chain of --k "
                        f"drafts); auto (default): {AUTO_TREE_BUDGET} on a GPU, 0 on a CPU")
    g.add_argument("--split", type=int, help="first layer run by the tail (default: half the layers)")
    g.add_argument("--device", help="cpu, cuda, cuda:N, or cuda:0,cuda:1 to spread the slice over two GPUs "
                                    "(cpu,cpu runs the same two segments on the CPU, to check such a layout's "
                                    "answers; default: cuda when available)")
    g.add_argument("--draft-device", help="device of the draft model (default: a second GPU when two are "
                                          "visible, else --device)")
    g.add_argument("--load-in-4bit", action="store_true",
                   help="NF4 4-bit weights (bitsandbytes) for the target's layers, on head and tail")
    g.add_argument("--draft-load-in-4bit", action="store_true", help="NF4 4-bit weights for the draft model")
    g.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights dtype (default auto: bf16, fp16 on GPUs without bf16, fp32 on CPU)")
    g.add_argument("--no-cuda-graphs", action="store_true",
                   help="run the draft and the verify forwards eagerly (debugging, comparisons)")
    g.add_argument("--no-compile-draft", action="store_true",
                   help="skip torch.compile of the draft model (faster start, slower drafting)")
    g.add_argument("--max-in-flight", type=int, metavar="N",
                   help=f"frames sent over the relay before their verdicts come when the head streams shallow "
                        f"frames (it measures whether that beats one frame per round trip on the link), each "
                        f"hanging in the live tree below the frames before it; the number in use follows the "
                        f"measured link and compute (1 = one frame per round trip always; default {d.max_in_flight})")
    g.add_argument("--draft-ahead", type=int, metavar="N",
                   help=f"draft steps the head may run while a verdict travels over the relay, growing the live "
                        f"tree's likeliest nodes (measured to spare the next frame no steps of its own; 0 = none; "
                        f"default {d.draft_ahead})")
    g.add_argument("--max-context", type=int, help=f"context window in tokens (default {d.max_context})")
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", help="one-shot: answer this prompt and exit")
    g.add_argument("--max-new-tokens", type=int, help=f"reply length limit (default {d.max_new_tokens})")
    g.add_argument("--temperature", type=float, help="0 = greedy (default 0), at most 2")
    g.add_argument("--top-k", type=int, help="sample from the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, help="nucleus sampling threshold (1 = off)")
    g.add_argument("--seed", type=int, help="seed for reproducible sampling")
    g.add_argument("--system", help="system message for the chat template")
    g.add_argument("--no-chat-template", action="store_true", help="use the prompt text as is")
    g.add_argument("--json", action="store_true", help="one-shot: print one JSON object with the reply and figures")
    g = p.add_argument_group("two machines")
    g.add_argument("--relay", help="relay URL, ws://HOST:PORT or wss://... (default: local mode)")
    g.add_argument("--token", help="relay token (or SFCHAT_TOKEN)")
    g.add_argument("--session", help="session name shared by head and tail (default 'default')")
    g.add_argument("--tail", action="store_true", help="run as the tail node (verifier) behind --relay")
    g.add_argument("--secret", help="the pairing code the tail printed (a tail without one makes one); the "
                                    "relay never sees it. Prefer SFCHAT_CODE or the prompt on a terminal: "
                                    "a command line is visible to every user of the machine (ps)")
    g.add_argument("--models-dir", help="tail: local model directories a head may name must lie inside this "
                                        "directory (several: separated by " + repr(os.pathsep) + "); default: "
                                        "hub ids only")
    g.add_argument("--insecure", action="store_true",
                   help="relay mode without end-to-end encryption: the relay can read and alter the chat")
    g.add_argument("--round-timeout", type=float,
                   help="seconds without a verdict before the head reconnects (default 60)")
    g.add_argument("--reconnect-timeout", type=float,
                   help="seconds the head keeps trying to get a tail back before giving up (default 300)")
    g = p.add_argument_group("the chat screen on another machine")
    g.add_argument("--offer-chat", action="store_true",
                   help="head: offer this head's chat screen, through --relay, to one `sfchat --remote` on your own "
                        "machine (a notebook has no terminal); prints a chat code and the command to run there")
    g.add_argument("--chat-session", help="--offer-chat: the relay session of the chat screen (default: --session "
                                          "with -chat added)")
    g.add_argument("--remote", action="store_true",
                   help="only the chat screen, driving a head that runs elsewhere with --offer-chat: needs no torch "
                        "and no model; --relay and --session as that head printed them, its chat code when asked "
                        "(or SFCHAT_CODE)")
    g = p.add_argument_group("OpenAI-compatible server")
    g.add_argument("--serve", action="store_true", help="serve the model over HTTP (OpenAI chat completions API)")
    g.add_argument("--host", help="--serve: address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, help="--serve: port to listen on (default 8000)")
    g.add_argument("--api-key", help="--serve: require Authorization: Bearer KEY; prefer SFCHAT_API_KEY: a command "
                                      "line is visible to every user of the machine (ps)")
    g.add_argument("--max-queue", type=int, help="--serve: requests that may wait for the model; more get 429 "
                                                 "(default 16)")
    g = p.add_argument_group("files")
    g.add_argument("--config", type=Path, help="TOML settings file (default: the platform config dir)")
    g.add_argument("--history", help="chat history SQLite file (default: the platform data dir)")
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    given = {FLAG_FIELDS[k]: v for k, v in vars(args).items() if k in FLAG_FIELDS}
    if getattr(args, "no_chat_template", False):
        given["chat_template"] = False
    if getattr(args, "no_cuda_graphs", False):
        given["cuda_graphs"] = False
    if getattr(args, "no_compile_draft", False):
        given["compile_draft"] = False
    if getattr(args, "insecure", False):
        given["insecure"] = True
    return merged(given, getattr(args, "config", None))


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
    from sfchat.node.prompts import make_sampling

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
    sampling = make_sampling(s.temperature, s.top_k, s.top_p, s.seed)
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


# flags a tail cannot use: the head's hello decides what the tail loads, and the reply is the head's
HEAD_ONLY = ("model", "draft", "revision", "draft_revision", "k", "tree_budget", "split", "dtype", "load_in_4bit",
             "draft_load_in_4bit", "max_context", "draft_device", "max_in_flight", "draft_ahead", "prompt",
             "max_new_tokens", "temperature", "top_k", "top_p", "seed", "system", "serve", "offer_chat", "remote")


def refuse_ignored(args: argparse.Namespace, s: Settings) -> None:
    """Inputs that would be ignored are refused, and a setting from the environment is named as such."""
    if getattr(args, "tail", False):
        ignored = [f"--{name.replace('_', '-')}" for name in HEAD_ONLY if name in vars(args)]
        if ignored:
            raise UserError(f"--tail takes no {', '.join(ignored)}: the head tells its tail which model, revision, "
                            "split, dtype and quantisation to load and how to generate; give them to the head")
    model = os.environ.get("SFCHAT_MODEL")
    if model and "model" not in vars(args) and s.model == model and not getattr(args, "tail", False):
        path = Path(model).expanduser()
        if (model.startswith((".", "/", "~")) or model.count("/") > 1) and not path.exists():
            raise UserError(f"SFCHAT_MODEL={model!r} (set in the environment) names a model directory that does not "
                            "exist: point it at a model, unset it, or give --model")


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
        return serve_http(ask_secret(with_models(s), False), args)
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
    if not 0 <= options.port <= 65535 or options.max_queue < 1:
        raise UserError("--port must be 0..65535 and --max-queue at least 1")
    return options


def serve_http(s: Settings, args: argparse.Namespace) -> int:
    """``--serve``: the OpenAI-compatible endpoint (sfchat/serve)."""
    from sfchat.serve.main import serve

    return serve(s, serve_options(args))


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

    path = Path(s.history) if s.history else history_path()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # chats are private
    except OSError as exc:
        raise UserError(f"cannot create the history directory {path.parent}: {exc}") from None
    params = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_k": s.top_k,
              "top_p": s.top_p, "seed": s.seed}
    mode = f"relay {s.relay} session {s.session}" if s.relay else "local"
    worker = RuntimeWorker(s)
    run_tui(worker, path, params, f"sfchat — {s.model} ({mode}) — loading…")
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
