"""``sfchat --serve`` on a head in relay mode: a real relay and tail process on loopback."""

from __future__ import annotations

import dataclasses

import openai
from serve_clients import metrics, settings_for
from machines import SECRET, TOKEN, start_relay, start_tail

from sfchat.events import ReplyFinished
from sfchat.node.prompts import make_sampling
from sfchat.serve.app import ServeOptions
from sfchat.node.worker import open_head
from sfchat.serve.main import Server


def test_a_relay_mode_head_serves_what_local_mode_generates(zoo):
    relay, url = start_relay()
    tail = start_tail(url, "serve", zoo["tokenizer"].parent)
    srv = None
    try:
        relayed = dataclasses.replace(settings_for(zoo), relay=url, token=TOKEN, secret=SECRET, session="serve")
        srv = Server(relayed, ServeOptions(port=0)).start()
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "a relay joins two machines"}]
        r = c.chat.completions.create(model=relayed.model, messages=messages, max_tokens=16)
        assert r.model_extra["sfchat"]["mode"] == "relay"
        local = open_head(settings_for(zoo), lambda e: None)
        done = list(local.reply(local.encode(messages), 16, make_sampling(0, 0, 1.0, 0)))[-1]
        assert isinstance(done, ReplyFinished)
        assert r.choices[0].message.content == done.text
        assert r.usage.completion_tokens == len(done.token_ids)
        m = metrics(srv)
        assert m[("sfchat_link_state", frozenset({("sfchat_link_state", "connected")}))] == 1
        assert m[("sfchat_round_trip_seconds_count", frozenset())] == r.model_extra["sfchat"]["rounds"]
    finally:
        if srv is not None:
            srv.close()
        for proc in (tail, relay):
            proc.terminate()
            proc.wait(10)
