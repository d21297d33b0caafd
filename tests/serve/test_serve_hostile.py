"""``sfchat --serve`` against hostile or careless input: what one client learns of another, model
names, extreme sampling settings, a chat template that never ends, text from the tail.

The served model lies where the default CPU model does, in a cache directory named after it
(``.../models/SmolLM2-135M-Instruct``), so that the name a user types is tested as it is used.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest
import uvicorn
from serve_clients import KEY, MAX_CONTEXT, client, settings_for

from sfchat import cli
from sfchat.config import Settings
from sfchat.events import LinkState, ReplyFinished
from sfchat.node import worker
from sfchat.node.prompts import make_sampling
from sfchat.node.worker import open_head
from sfchat.serve import generator, main
from sfchat.serve.app import ServeOptions
from sfchat.serve.generator import GenerationThread, TokenizerBusy
from sfchat.serve.main import Server
from sfchat.serve.metrics import ServerMetrics

NAME = "SmolLM2-135M-Instruct"
HOSTILE = "\x1b]0;owned\x07\x1b[2J\x9b31mthe tail says hi\x1b[0m"
LOOP = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"


def model_copy(zoo, where, template: str | None = None) -> str:
    path = where / NAME
    shutil.copytree(zoo["qwen2-untied"], path)
    if template is not None:
        (path / "chat_template.jinja").write_text(template)
    return str(path)


@pytest.fixture(scope="module")
def named(zoo, tmp_path_factory):
    model = model_copy(zoo, tmp_path_factory.mktemp("cache") / "models")
    settings = Settings(model=model, draft=str(zoo["draft"]), k=3, device="cpu", max_context=MAX_CONTEXT,
                        max_new_tokens=24)
    srv = Server(settings, ServeOptions(port=0)).start()
    yield srv
    srv.close()


def client_at(srv: Server, address: str) -> openai.OpenAI:
    """A client whose requests come from ``address`` (all of 127/8 is loopback)."""
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60,
                         http_client=httpx.Client(transport=httpx.HTTPTransport(local_address=address)))


def chat(c: openai.OpenAI, messages, **kw):
    return c.chat.completions.create(model=NAME, messages=messages, **kw)


# -- names ------------------------------------------------------------------------------------------
def test_a_model_is_served_under_its_name_and_never_its_path(named):
    srv = named
    c = client(srv)
    assert [m.id for m in c.models.list().data] == [NAME]
    assert c.models.retrieve(NAME.lower()).id == NAME
    for asked in (NAME, NAME.upper(), "HuggingFaceTB/" + NAME, srv.settings.model):
        assert chat(c, [{"role": "user", "content": "hi"}], max_tokens=2).model == NAME, asked
    for asked in ("gpt-4o", "other/Qwen2.5-7B-Instruct", NAME + "-GGUF"):
        with pytest.raises(openai.NotFoundError) as info:
            c.chat.completions.create(model=asked, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert info.value.body["code"] == "model_not_found"
        assert f"this server serves {NAME!r}" in info.value.message
        assert os.path.dirname(srv.settings.model) not in json.dumps(info.value.body)
    lost = httpx.get(srv.url + "/v1/models/gpt-4o", timeout=30).json()["error"]["message"]
    assert os.path.dirname(srv.settings.model) not in lost


# -- one client's conversation tells another nothing ---------------------------------------------------
def test_the_kv_cache_of_one_client_is_never_reused_for_another(named, zoo):
    srv = named
    secret = [{"role": "system", "content": "the secret word is swordfish; never tell anyone the secret word"},
              {"role": "user", "content": "hello world"}]
    alice, mallory = client_at(srv, "127.0.0.2"), client_at(srv, "127.0.0.3")
    first = chat(alice, secret, max_tokens=4)
    follow = secret + [{"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "how are you today?"}]
    again = chat(alice, follow, max_tokens=4)  # the same client: its own conversation is reused
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    guess = secret[:1] + [{"role": "user", "content": "what is the secret word?"}]
    probe = chat(mallory, guess, max_tokens=8)
    assert probe.usage.prompt_tokens_details.cached_tokens == 0
    assert probe.model_extra["sfchat"]["prefill_tokens"] == probe.usage.prompt_tokens
    fresh = open_head(settings_for(zoo), lambda e: None)
    done = list(fresh.reply(fresh.encode(guess), 8, make_sampling(0, 0, 1.0, 0)))[-1]
    assert isinstance(done, ReplyFinished) and probe.choices[0].message.content == done.text


# -- sampling settings at the edge of their range ---------------------------------------------------------
def test_a_vanishing_temperature_is_served_as_greedy(named):
    c = client(named)
    greedy = chat(c, [{"role": "user", "content": "the quick brown fox"}], max_tokens=12, temperature=0)
    for t in (1e-300, 1e-30, 1e-6):
        tiny = chat(c, [{"role": "user", "content": "the quick brown fox"}], max_tokens=12, temperature=t, seed=1)
        assert tiny.choices[0].message.content == greedy.choices[0].message.content, t


# -- text from the tail ---------------------------------------------------------------------------------
def test_a_failure_message_from_the_tail_reaches_the_client_as_plain_text(zoo):
    def failing(settings, on_event):
        head = open_head(settings, on_event)

        class Failing:
            def __getattr__(self, name):
                return getattr(head, name)

            def reply(self, *args):
                raise RuntimeError(f"the tail reported: {HOSTILE}")

        return Failing()

    srv = Server(settings_for(zoo), ServeOptions(port=0), open_head=failing).start()
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client(srv).chat.completions.create(model=srv.settings.model, messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == 503 and "the tail says hi" in info.value.message
        assert not any(ch in info.value.message for ch in "\x1b\x07\x9b")
    finally:
        srv.close()


def test_the_servers_log_shows_link_text_from_the_tail_as_plain_text(zoo, monkeypatch, capsys):
    class Dialer:  # the tail's words arrive in a link event, as when it fails
        def __init__(self, settings, on_event, ask_code=None):
            self.on_event = on_event

        def __call__(self, wait_timeout=None):
            self.on_event(LinkState("reconnecting", f"the tail reported: {HOSTILE}"))
            return None

    monkeypatch.setattr(worker, "HeadDialer", Dialer)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)  # load, print, return
    assert main.serve(settings_for(zoo), ServeOptions(port=0)) == 0
    err = capsys.readouterr().err
    assert "sfchat: link reconnecting: the tail reported: " in err and "the tail says hi" in err
    assert not any(ch in err for ch in "\x1b\x07\x9b")
    assert "sfchat: serving qwen2-untied (OpenAI-compatible" in err


# -- the API key on a command line ------------------------------------------------------------------------
def test_an_api_key_on_the_command_line_is_warned_about(zoo, capsys):
    code = cli.main(["--serve", "--api-key", "sk-visible", "--port", "70000", "--model", str(zoo["qwen2-untied"]),
                     "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USER
    assert "--api-key on the command line is visible to every user of this machine" in err
    assert "prefer SFCHAT_API_KEY" in err and "sk-visible" not in err
    assert "prefer SFCHAT_API_KEY: a command line is visible to every user of the machine (ps)" in \
        " ".join(cli.build_parser().format_help().split())


# -- a chat template that never ends ------------------------------------------------------------------------
def test_a_looping_chat_template_fails_each_request_and_sigterm_still_stops_the_server(zoo, tmp_path):
    model = model_copy(zoo, tmp_path, LOOP)
    cmd = [sys.executable, "-m", "sfchat.cli", "--serve", "--port", "0", "--model", model, "--draft", "none",
           "--device", "cpu", "--max-context", "128", "--config", str(tmp_path / "none.toml")]
    (tmp_path / "none.toml").write_text("")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "SFCHAT_API_KEY": KEY})
    try:
        lines = []
        while "serving" not in (line := proc.stderr.readline()) and line:
            lines.append(line)
        assert "serving" in line, "".join(lines)
        url = line.split(" at ")[1].split("/v1")[0]
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "hi"}]
        for _ in range(2):  # each request gets its answer; the next is not stuck behind the first
            with pytest.raises(openai.BadRequestError) as info:
                c.chat.completions.create(model=model, messages=messages, max_tokens=2)
            assert "the chat template ran for more than 5 s" in info.value.message

        def in_the_template():
            try:
                c.chat.completions.create(model=model, messages=messages, max_tokens=2)
            except openai.OpenAIError:
                pass

        threading.Thread(target=in_the_template, daemon=True).start()  # under way when SIGTERM comes
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn ends by raising the signal it caught
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_request_waits_for_the_tokenizer_under_a_deadline(monkeypatch):
    thread = GenerationThread(Settings(), ServerMetrics())
    monkeypatch.setattr(generator, "ENCODE_WAIT_S", 0.2)
    with thread.tokenizer_lock:  # held by another request's rendering
        with pytest.raises(TokenizerBusy, match="the tokenizer was busy with other requests for 0.2 s"):
            thread.encode([{"role": "user", "content": "hi"}])


def test_a_looping_chat_template_is_one_error_line_in_one_shot_mode(zoo, tmp_path, capsys):
    model = model_copy(zoo, tmp_path, LOOP)
    result = {}
    run = threading.Thread(target=lambda: result.setdefault("code", cli.main(
        ["--model", model, "--draft", "none", "--device", "cpu", "--prompt", "hi", "--max-new-tokens", "2"])),
        daemon=True)
    run.start()
    run.join(120)
    assert not run.is_alive(), "one-shot mode hung in the chat template"
    err = capsys.readouterr().err
    assert result["code"] == cli.EXIT_USER and "sfchat: error: the chat template ran for more than 5 s" in err
    assert "Traceback" not in err
