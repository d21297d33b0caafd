"""``sfchat --serve`` driven by the real ``openai`` client: tiny models, local mode, CPU, loopback.

The servers run in-process (``sfchat.serve.main.Server``, the same object ``sfchat --serve``
runs); one test starts the real command. Parity is checked against one-shot mode
(``sfchat --prompt ... --json``) and against a fresh ``Head``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from sfchat import cli
from sfchat.serve.app import ServeOptions
from sfchat.node.worker import open_head
from sfchat.serve.main import Server

from serve_clients import (  # noqa: F401  (fixture)
    KEY, MAX_CONTEXT, Gate, ask, client, metrics, served, server, settings_for, wait_until,
)


def one_shot(zoo, capsys, prompt: str, n: int) -> dict:
    s = settings_for(zoo)
    argv = ["--model", s.model, "--draft", s.draft, "--k", "3", "--device", "cpu", "--max-context", str(MAX_CONTEXT),
            "--max-new-tokens", str(n), "--prompt", prompt, "--json"]
    capsys.readouterr()
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


# -- replies ---------------------------------------------------------------------------------------
def test_non_streaming_equals_one_shot_mode(server, zoo, capsys):
    expected = one_shot(zoo, capsys, "hello world", 20)
    r = ask(client(server), server, max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.model == served(server) == "qwen2-untied"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected["text"]
    assert r.choices[0].finish_reason == {"eos": "stop", "length": "length"}[expected["finish_reason"]]
    assert r.usage.prompt_tokens == expected["prompt_tokens"]
    assert r.usage.completion_tokens == len(expected["token_ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    figures = r.model_extra["sfchat"]
    assert figures["rounds"] >= 1 and figures["k"] == 3 and figures["mode"] == "local"
    assert figures["tokens_per_round"] == pytest.approx(r.usage.completion_tokens / figures["rounds"], abs=1e-3)
    assert sum(figures["accepted_histogram"]) == figures["rounds"]
    assert {"tps", "rtt_ms", "ttft_s", "round_ms"} <= set(figures)


def test_streaming_sends_chunks_that_add_up_to_the_reply(server):
    c = client(server)
    whole = ask(c, server, "the quick brown fox", max_tokens=16)
    chunks = list(ask(c, server, "the quick brown fox", max_tokens=16, stream=True,
                      stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and not any(reasons[:-1])
    last_choice = [ch for ch in chunks if ch.choices][-1]
    assert last_choice.model_extra["sfchat"]["rounds"] >= 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # the raw stream ends with [DONE]
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_a_follow_up_reuses_the_cached_context_and_still_equals_a_fresh_session(server, zoo):
    from sfchat.events import ReplyFinished
    from sfchat.node.prompts import make_sampling

    c = client(server)
    first = [{"role": "user", "content": "speculative decoding drafts tokens"}]
    a = c.chat.completions.create(model=served(server), messages=first, max_tokens=12)
    follow = first + [{"role": "assistant", "content": a.choices[0].message.content},
                      {"role": "user", "content": "and the target verifies them"}]
    b = c.chat.completions.create(model=served(server), messages=follow, max_tokens=12)
    assert b.usage.prompt_tokens > a.usage.prompt_tokens
    assert b.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens
    assert b.model_extra["sfchat"]["prefill_tokens"] == b.usage.prompt_tokens - \
        b.usage.prompt_tokens_details.cached_tokens
    fresh = open_head(settings_for(zoo), lambda e: None)
    events = list(fresh.reply(fresh.encode(follow), 12, make_sampling(0, 0, 1.0, 0)))
    done = events[-1]
    assert isinstance(done, ReplyFinished) and events[0].reused_tokens == 0
    assert b.choices[0].message.content == done.text
    assert b.usage.completion_tokens == len(done.token_ids)


def test_stop_strings_cut_the_reply_and_the_usage(server, zoo, capsys):
    from transformers import AutoTokenizer

    c = client(server)
    generated = one_shot(zoo, capsys, "numbers 0 1 2", 24)
    whole = ask(c, server, "numbers 0 1 2", max_tokens=24).choices[0].message.content
    assert whole == generated["text"]
    stop = whole[6:9]
    at = whole.find(stop)
    r = ask(c, server, "numbers 0 1 2", max_tokens=24, stop=[stop, "never-in-it-\u2603"])
    assert r.choices[0].message.content == whole[:at]
    assert r.choices[0].finish_reason == "stop"
    streamed = ask(c, server, "numbers 0 1 2", max_tokens=24, stop=stop, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == whole[:at]
    # the usage counts the tokens up to the one that completes the stop string, not the whole round
    tok = AutoTokenizer.from_pretrained(zoo["qwen2-untied"])
    ids = generated["token_ids"]
    need = next(j for j in range(1, len(ids) + 1)
                if len(tok.decode(ids[:j], skip_special_tokens=True)) >= at + len(stop))
    assert r.usage.completion_tokens == need


def test_seeded_sampling_repeats_and_differs_from_greedy(server):
    c = client(server)
    kw = dict(max_tokens=16, temperature=1.2, top_p=0.95, seed=1234)
    a, b = ask(c, server, "hello", **kw), ask(c, server, "hello", **kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    other = [ask(c, server, "hello", **{**kw, "seed": s}).choices[0].message.content for s in (1, 2, 3)]
    assert any(t != a.choices[0].message.content for t in other)


def test_models_lists_the_served_model(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [served(server)]
    assert client(server).models.retrieve(served(server)).id == served(server)


# -- errors ----------------------------------------------------------------------------------------
def test_bad_requests_get_openai_error_objects(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as info:
        ask(c, server, temperature=5)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        ask(c, server, max_tokens=0)
    with pytest.raises(openai.BadRequestError) as info:
        ask(c, server, extra_body={"frobnicate": 1})
    assert "frobnicate" in info.value.message
    with pytest.raises(openai.NotFoundError) as info:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found"
    raw = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [', timeout=30)
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    big = httpx.post(server.url + "/v1/chat/completions", content=b" " * (2 << 20), timeout=30)
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
    lost = httpx.get(server.url + "/v2/anything", timeout=30)
    assert lost.status_code == 404 and lost.json()["error"]["message"]


def test_a_prompt_past_the_context_window_names_both_sizes(server):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client(server), server, "the quick brown fox jumps over the lazy dog " * 40)
    message = info.value.message
    assert f"context window is {MAX_CONTEXT} tokens" in message
    n = int(message.split("the prompt has ")[1].split()[0])
    assert n >= MAX_CONTEXT
    assert info.value.body["code"] == "context_length_exceeded"


def test_the_api_key_is_required_when_set(zoo):
    srv = Server(settings_for(zoo), ServeOptions(port=0, api_key=KEY)).start()
    try:
        with pytest.raises(openai.AuthenticationError) as info:
            ask(client(srv, "sk-wrong"), srv, max_tokens=2)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        bare = httpx.get(srv.url + "/v1/models", timeout=30)
        assert bare.status_code == 401 and "no API key" in bare.json()["error"]["message"]
        assert httpx.get(srv.url + "/metrics", timeout=30).status_code == 401
        assert ask(client(srv, KEY), srv, max_tokens=2).usage.completion_tokens >= 1
        assert metrics(srv)[("sfchat_http_requests_total", frozenset({("route", "/v1/models"), ("code", "401")}))] == 1
    finally:
        srv.close()


# -- one generation at a time: the queue and cancelling ------------------------------------------------
@pytest.fixture(scope="module")
def gated(zoo):
    gate = Gate()
    srv = Server(settings_for(zoo), ServeOptions(port=0, max_queue=1), open_head=gate.load).start()
    yield srv, gate
    for _ in range(1000):
        gate.permits.release()
    srv.close()


def cancelled_count(srv) -> float:
    return metrics(srv).get(("sfchat_generations_total", frozenset({("finish_reason", "cancelled")})), 0.0)


def test_a_full_queue_answers_429_and_the_waiting_request_is_served(gated):
    srv, gate = gated
    gate.drain()
    results = {}

    def run(name, **kw):
        results[name] = ask(client(srv), srv, max_tokens=3, **kw)

    first = threading.Thread(target=run, args=("first",))
    first.start()
    wait_until(gate.waiting.is_set, "the first request to hold the model")
    second = threading.Thread(target=run, args=("second",))
    second.start()
    wait_until(lambda: metrics(srv)[("sfchat_queue_depth", frozenset())] == 1, "the second request to queue")
    with pytest.raises(openai.RateLimitError) as info:
        ask(client(srv), srv, max_tokens=3)
    assert info.value.status_code == 429 and info.value.body["code"] == "queue_full"
    for _ in range(6):
        gate.permits.release()
    first.join(60)
    second.join(60)
    assert results["first"].usage.completion_tokens >= 1 and results["second"].usage.completion_tokens >= 1
    m = metrics(srv)
    assert m[("sfchat_http_requests_total", frozenset({("route", "/v1/chat/completions"), ("code", "429")}))] == 1


def test_a_client_that_disconnects_mid_stream_cancels_its_generation(gated):
    srv, gate = gated
    gate.drain()
    before = cancelled_count(srv)
    tokens_before = metrics(srv)[("sfchat_completion_tokens_total", frozenset())]
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 200, "stream": True}
    gate.permits.release()  # one round, then the generation waits at the gate
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        role = json.loads(next(line for line in lines if line)[6:])
        assert role["choices"][0]["delta"]["role"] == "assistant"
        wait_until(lambda: gate.passed == 1 and gate.waiting.is_set(), "the second round to wait at the gate")
    # the connection is closed here: the server must cancel the generation held at the gate
    wait_until(lambda: cancelled_count(srv) == before + 1, "the generation to be cancelled")
    m = metrics(srv)
    generated = m[("sfchat_completion_tokens_total", frozenset())] - tokens_before
    assert 1 <= generated <= srv.settings.k + 1  # the one round let through, not 200 tokens
    for _ in range(4):
        gate.permits.release()
    assert ask(client(srv), srv, max_tokens=2).usage.completion_tokens >= 1  # the model is free again


def test_a_non_streaming_client_that_gives_up_cancels_too(gated):
    srv, gate = gated
    gate.drain()
    before = cancelled_count(srv)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(srv.url + "/v1/chat/completions", timeout=1.0,
                   json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 200})
    wait_until(lambda: cancelled_count(srv) == before + 1, "the generation to be cancelled")


# -- metrics ---------------------------------------------------------------------------------------
def test_metrics_parse_and_add_up(zoo):
    srv = Server(settings_for(zoo), ServeOptions(port=0)).start()
    try:
        c = client(srv)
        replies = [ask(c, srv, text, max_tokens=10) for text in ("hello", "hello world", "the lazy dog")]
        m = metrics(srv)
        ok = ("sfchat_http_requests_total", frozenset({("route", "/v1/chat/completions"), ("code", "200")}))
        assert m[ok] == 3
        assert m[("sfchat_completion_tokens_total", frozenset())] == sum(r.usage.completion_tokens for r in replies)
        assert m[("sfchat_prompt_tokens_total", frozenset())] == sum(r.usage.prompt_tokens for r in replies)
        rounds = sum(r.model_extra["sfchat"]["rounds"] for r in replies)
        assert m[("sfchat_tokens_per_round_count", frozenset())] == rounds
        assert m[("sfchat_tokens_per_round_sum", frozenset())] == sum(r.usage.completion_tokens for r in replies)
        assert m[("sfchat_round_trip_seconds_count", frozenset())] == rounds
        assert m[("sfchat_reply_tokens_per_second_count", frozenset())] == 3
        assert m[("sfchat_time_to_first_token_seconds_count", frozenset())] == 3
        assert m[("sfchat_link_state", frozenset({("sfchat_link_state", "local")}))] == 1
        assert m[("sfchat_link_state", frozenset({("sfchat_link_state", "connected")}))] == 0
        assert m[("sfchat_generating", frozenset())] == 0
    finally:
        srv.close()


# -- the command -----------------------------------------------------------------------------------
def test_a_busy_port_or_a_bad_flag_is_one_error_line(zoo, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main(["--serve", "--host", "127.0.0.1", "--port", str(port), "--model", str(zoo["qwen2-untied"]),
                         "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USER
    assert f"sfchat: error: cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
    code = cli.main(["--serve", "--port", str(port), "--max-queue", "0"])
    assert code == cli.EXIT_USER and "--max-queue" in capsys.readouterr().err


def test_sfchat_serve_runs_with_the_key_from_the_environment(zoo, tmp_path):
    env = {**os.environ, "SFCHAT_API_KEY": KEY}
    cmd = [sys.executable, "-m", "sfchat.cli", "--serve", "--port", "0",
           "--model", str(zoo["qwen2-untied"]), "--draft", "none", "--device", "cpu", "--max-context", "128",
           "--config", str(tmp_path / "none.toml")]
    (tmp_path / "none.toml").write_text("")
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for _ in range(50):
            line = proc.stderr.readline()
            lines.append(line)
            if "serving" in line or not line:
                break
        assert "serving" in lines[-1], "".join(lines)
        assert "API key required" in lines[-1]  # from SFCHAT_API_KEY
        url = lines[-1].split(" at ")[1].split("/v1")[0]
        assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        r = c.chat.completions.create(model="qwen2-untied", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=3)
        assert r.usage.completion_tokens >= 1 and r.model_extra["sfchat"]["k"] == 0
        proc.send_signal(signal.SIGINT)  # Ctrl+C: a local server has no link to report as closed
        rest = proc.communicate(timeout=60)[1]
        assert proc.returncode in (0, 130) and "sfchat: link" not in rest, rest
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
