"""``sfchat --serve``: bind, load the models, run the ASGI app under uvicorn until Ctrl+C.

Contract
--------
``serve(settings, options)`` is what the CLI calls: it binds the socket first (a port in use is
a ``UserError`` before any model is loaded), warns on stderr when the address is not loopback
and no API key is set, loads the session on the generation thread (progress and link trouble
as lines on stderr, as in one-shot mode), prints the URL, and serves until interrupted.
``Server(settings, options, open_head=...)`` is the same as an object: ``start()`` returns once it
accepts connections (``url`` then names it; port 0 picks a free one), ``close()`` stops it.
The tests, ``bench/serve_load.py`` and ``serve.cli.start_server`` (a notebook's cell) run it
in-process that way; ``set_code(code)`` gives a running server a new pairing code. ``api_key_from(flag)``: the
flag (with a warning on stderr: a command line is visible to every user of the machine), else
``SFCHAT_API_KEY``. uvicorn runs with its h11 protocol behind the ``gate`` (no socket-counting
``limit_concurrency``, no proxy headers: a client is its socket's address), and a shutdown
waits at most ``SHUTDOWN_S`` for requests in progress. ``report(event)`` writes loading and
link events on stderr, every string in them ``plaintext.plain`` (not "local", nor the "closed" of
the server's own shutdown: Ctrl+C is no link failure).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import threading
import time

from sfchat import UserError
from sfchat.config import Settings
from sfchat.console import show_download
from sfchat.events import LinkState
from sfchat.node.worker import open_head
from sfchat.plaintext import plain
from sfchat.serve.app import ServeOptions, build_app
from sfchat.serve.gate import ConnectionGate, GateLimits
from sfchat.serve.generator import GenerationThread
from sfchat.serve.metrics import ServerMetrics
from sfchat.serve.protocol import served_name

SHUTDOWN_S = 10  # how long Ctrl+C or SIGTERM waits for requests in progress


def api_key_from(flag: str | None) -> str | None:
    if flag:
        print("sfchat: warning: --api-key on the command line is visible to every user of this machine (ps, "
              "/proc/*/cmdline) and stays in your shell history; prefer SFCHAT_API_KEY", file=sys.stderr, flush=True)
    return flag or os.environ.get("SFCHAT_API_KEY") or None


def report(ev) -> None:
    """A loading or link event as a line on stderr (``--serve`` has no screen)."""
    show_download(ev)
    if isinstance(ev, LinkState) and ev.state not in ("local", "closed"):
        detail = f": {plain(ev.detail)}" if ev.detail else ""
        print(f"sfchat: link {plain(ev.state)}{detail}", file=sys.stderr, flush=True)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(options: ServeOptions) -> str | None:
    if is_loopback(options.host) or options.api_key:
        return None
    return (f"sfchat: warning: serving on {plain(options.host)} without --api-key: anyone who can reach this "
            f"address can use the model; set --api-key or SFCHAT_API_KEY, or bind to 127.0.0.1")


def bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"--host {host!r}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class Server:
    def __init__(self, settings: Settings, options: ServeOptions = ServeOptions(), open_head=open_head,
                 on_event=lambda e: None):
        self.settings, self.options = settings, options
        self.metrics = ServerMetrics(settings.depth)
        self.generator = GenerationThread(settings, self.metrics, options.max_queue, open_head, on_event)
        self.sock: socket.socket | None = None
        self.uvicorn = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def bind(self) -> None:
        self.sock = bind(self.options.host, self.options.port)

    def load(self, timeout: float | None = None):
        return self.generator.start(timeout)

    def set_code(self, code: str) -> None:
        """A new pairing code for the running server (relay mode), from any thread: the next time
        the head needs one (its tail came back without its state and printed a new code, or the
        code it had was refused) it pairs with this one; no restart. A code too short is a UserError."""
        self.generator.set_code(code)

    def config(self):
        import uvicorn

        o = self.options
        app = build_app(self.generator, self.metrics, o)
        gate = ConnectionGate(GateLimits(o.header_timeout, o.max_waiting, o.max_waiting_per_client), self.metrics)
        # the gate closes idle keep-alive connections (and counts them) before uvicorn's own timer would
        return uvicorn.Config(app, http=gate.protocol(), ws="none", proxy_headers=False, log_level="warning",
                              access_log=False, lifespan="off", timeout_keep_alive=o.header_timeout + 5,
                              timeout_graceful_shutdown=SHUTDOWN_S, h11_max_incomplete_event_size=64 * 1024)

    def start(self, timeout: float = 60.0, load_timeout: float | None = None) -> "Server":
        """Bind, load (within ``load_timeout`` s: a UserError past it) and serve on a background
        thread (the tests', the benchmark's and a notebook's way)."""
        import uvicorn

        self.bind()
        self.load(load_timeout)
        self.uvicorn = uvicorn.Server(self.config())
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]},
                                       name="sfchat-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.uvicorn.started:
            raise UserError("the HTTP server did not start")
        return self

    def close(self) -> None:
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.generator.close()
        if self.sock is not None:
            self.sock.close()


def serve(settings: Settings, options: ServeOptions) -> int:
    import uvicorn

    if warning := exposure_warning(options):
        print(warning, file=sys.stderr, flush=True)
    server = Server(settings, options, on_event=report)
    server.bind()
    print(f"sfchat: loading {plain(settings.model)} ...", file=sys.stderr, flush=True)
    info = server.load()
    for note in server.generator.head.defaults.notes:
        print(f"sfchat: warning: {plain(note)}", file=sys.stderr, flush=True)
    try:
        print(f"sfchat: serving {plain(served_name(info.model))} (OpenAI-compatible, {info.mode} mode) at "
              f"{server.url}/v1 - metrics at {server.url}/metrics{'; API key required' if options.api_key else ''}",
              file=sys.stderr, flush=True)
        uvicorn.Server(server.config()).run(sockets=[server.sock])
    finally:
        server.generator.close()
        server.sock.close()
    return 0
