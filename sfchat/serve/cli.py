"""``sfchat --serve``, from the command line and from a notebook's cell.

Contract: ``serve_options(args)`` turns the parsed ``--host``, ``--port``, ``--api-key`` (else
``SFCHAT_API_KEY``: ``main.api_key_from``) and ``--max-queue`` into ``app.ServeOptions``, a port
outside 0..65535 or a queue under 1 a ``UserError`` (before any model is built or loaded).
``start_server(argv, load_timeout)`` is ``sfchat --serve ARGV`` inside this process (a notebook's
kernel), in the background: the flags and the environment (SFCHAT_RELAY, SFCHAT_TOKEN,
SFCHAT_CODE, ...) are read as the command line reads them (``--serve`` itself may be given or
not), the relay is checked, the exposure warning printed, the models load (progress on stderr),
and the running ``main.Server`` is returned once it answers: ``url``, ``set_code(code)`` (a new
pairing code without a restart), ``close()``. A server it started before in this process is
closed first, its models dropped and its port freed, so that running the cell again replaces the
server instead of failing beside it. Loading past ``load_timeout`` seconds (None: no limit)
fails; errors are ``UserError``s. The command line's own ``--serve`` runs ``main.serve``.
"""

from __future__ import annotations

import argparse
import sys

from sfchat import UserError
from sfchat.flags import build_parser, settings_from
from sfchat.node.startup import ask_secret, check_relay, with_models
from sfchat.serve.app import ServeOptions
from sfchat.serve.main import Server, api_key_from, exposure_warning, report


def serve_options(args: argparse.Namespace) -> ServeOptions:
    options = ServeOptions(host=getattr(args, "host", "127.0.0.1"), port=getattr(args, "port", 8000),
                           api_key=api_key_from(getattr(args, "api_key", None)),
                           max_queue=getattr(args, "max_queue", 16))
    if not 0 <= options.port <= 65535:
        raise UserError(f"--port must be 0..65535, not {options.port}")
    if options.max_queue < 1:
        raise UserError(f"--max-queue must be at least 1, not {options.max_queue}")
    return options


_started = None  # the server start_server last started in this process


def start_server(argv: list[str] = (), load_timeout: float | None = None) -> Server:
    """``sfchat --serve ARGV`` inside this process, in the background (see the module's contract)."""
    global _started
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
