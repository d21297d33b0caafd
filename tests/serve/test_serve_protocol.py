"""The server's torch-free parts: request validation, stop strings, the exposure warning, the key."""

from __future__ import annotations

import json

import pytest

from sfchat.serve.app import ServeOptions
from sfchat.serve.main import api_key_from, exposure_warning
from sfchat.serve.protocol import ApiError, Limits, parse_chat_request
from sfchat.serve.stops import StopMatcher

USER = [{"role": "user", "content": "hi"}]


def parse(**fields):
    return parse_chat_request(json.dumps({"messages": USER, **fields}).encode(), Limits(max_tokens=256))


def refusal(raw: bytes, limits: Limits = Limits(max_tokens=256)) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_chat_request(raw, limits)
    return info.value


def test_a_full_request_is_read():
    req = parse(model="m", max_completion_tokens=7, max_tokens=99, temperature=0.5, top_p=0.9, top_k=3, seed=-1,
                stop="END", stream=True, stream_options={"include_usage": True}, n=1, user="u", repetition_penalty=1.1)
    assert (req.model, req.max_tokens, req.gen.temperature, req.gen.top_p, req.gen.top_k, req.gen.seed) == \
        ("m", 7, 0.5, 0.9, 3, -1)
    assert req.gen.repetition_penalty == 1.1  # vLLM's extension, generate()'s penalty
    assert (req.stop, req.stream, req.include_usage) == (("END",), True, True)
    assert req.messages == ({"role": "user", "content": "hi"},)


def test_content_parts_and_developer_role():
    req = parse(messages=[{"role": "developer", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": None}])
    assert req.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                            {"role": "assistant", "content": ""})


@pytest.mark.parametrize("fields, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0]"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 10.5}, "repetition_penalty"),
    ({"repetition_penalty": "1.1"}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 257}, "max_tokens"),
    ({"max_completion_tokens": True}, "max_completion_tokens"),
    ({"seed": 1.5}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"n": 2}, "n"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"best_of": 3}, "best_of"),
    ({"model": 7}, "model"),
])
def test_bad_fields_are_named(fields, param):
    err = refusal(json.dumps({"messages": USER, **fields}).encode())
    assert err.status == 400
    assert err.param == param
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_messages_body_and_json_are_bounded():
    assert refusal(json.dumps({"messages": USER * 3}).encode(), Limits(max_messages=2)).param == "messages"
    assert refusal(b"x" * 101, Limits(max_body_bytes=100)).status == 413
    for raw in (b"{nope", b"[1, 2]", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000):
        err = refusal(raw)
        assert err.status == 400 and err.param is None


def test_stop_strings_split_across_pieces():
    m = StopMatcher(["STOP", "xyz"])
    out = [m.push(p) for p in ["abc S", "T", "OP after"]]
    assert out == ["abc ", "", ""]  # "S" and "T" are held back, then the stop cuts them off
    assert (m.hit, m.text, m.end) == (True, "abc ", 8)
    assert m.push("more") == "" and m.flush() == ""


def test_a_held_back_prefix_is_released_when_it_does_not_become_a_stop():
    m = StopMatcher(["STOP"])
    assert m.push("a ST") == "a "
    assert m.push("ART") == "START"
    assert m.push(" S") == " "
    assert m.flush() == "S"
    assert (m.hit, m.text) == (False, "a START S")


def test_the_earliest_stop_wins_and_no_stops_release_everything():
    m = StopMatcher(["world", "lo w"])
    assert m.push("hello world") == "hel"
    assert m.end == len("hello w")
    free = StopMatcher([])
    assert free.push("anything") == "anything" and not free.hit


def test_exposure_warning_and_api_key_from_the_environment(monkeypatch):
    assert exposure_warning(ServeOptions(host="127.0.0.1")) is None
    assert exposure_warning(ServeOptions(host="::1")) is None
    assert exposure_warning(ServeOptions(host="0.0.0.0", api_key="k")) is None
    assert "without --api-key" in exposure_warning(ServeOptions(host="0.0.0.0"))
    assert "without --api-key" in exposure_warning(ServeOptions(host="example.org"))
    monkeypatch.delenv("SFCHAT_API_KEY", raising=False)
    assert api_key_from(None) is None
    monkeypatch.setenv("SFCHAT_API_KEY", "from-env")
    assert api_key_from(None) == "from-env"
    assert api_key_from("flag") == "flag"
