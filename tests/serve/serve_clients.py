"""What the server's tests share: a server in this process on tiny models, clients of it, and
its metrics."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sfchat.config import Settings
from sfchat.node.worker import open_head
from sfchat.serve.app import ServeOptions
from sfchat.serve.main import Server
from sfchat.serve.protocol import served_name


MAX_CONTEXT = 256
KEY = "sk-test-key"


def settings_for(zoo, **kw) -> Settings:
    return Settings(model=str(zoo["qwen2-untied"]), draft=str(zoo["draft"]), k=3, device="cpu",
                    max_context=MAX_CONTEXT, max_new_tokens=24, **kw)


def client(server: Server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def served(server: Server) -> str:  # the name its model is served under: the directory's name
    return served_name(server.settings.model)


def ask(c: openai.OpenAI, server: Server, content: str = "hello world", **kw):
    return c.chat.completions.create(model=served(server), messages=[{"role": "user", "content": content}], **kw)


def metrics(server: Server) -> dict:
    """{(sample name, frozenset(labels)): value}, parsed by prometheus_client's own text parser."""
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {server.options.api_key}"}).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_until(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def serving(zoo, **options):
    """For a fixture to ``yield from``: a server of the tiny models on a free port, with these
    ``ServeOptions``, closed afterwards."""
    srv = Server(settings_for(zoo), ServeOptions(port=0, **options)).start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def server(zoo):
    yield from serving(zoo)


class Gate:
    """Wraps a Head so that each round waits for a permit from the test (or a cancel)."""

    def __init__(self):
        self.permits = threading.Semaphore(0)
        self.waiting = threading.Event()  # a round waits for a permit
        self.passed = 0  # rounds let through

    def drain(self) -> None:
        """No permits left over from an earlier test (call while nothing is generating)."""
        while self.permits.acquire(blocking=False):
            pass
        self.passed = 0

    def load(self, settings, on_event):
        session = open_head(settings, on_event)
        gate = self

        class Gated:
            def __getattr__(self, name):
                return getattr(session, name)

            def reply(self, ids, n, sampling, cancelled):
                def held():  # True (stop) only on a real cancel; without a permit for 60 s, go on
                    gate.waiting.set()
                    deadline = time.monotonic() + 60
                    while not cancelled():
                        if gate.permits.acquire(timeout=0.01) or time.monotonic() > deadline:
                            gate.waiting.clear()
                            gate.passed += 1
                            return False
                    return True

                return session.reply(ids, n, sampling, held)

        return Gated()
