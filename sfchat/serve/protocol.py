"""The OpenAI chat-completions wire format: request validation, error objects, response objects.

Contract
--------
``parse_chat_request(body, limits)`` turns the raw bytes of a ``POST /v1/chat/completions``
body into a ``ChatRequest`` or raises ``ApiError`` (status 400, or 413 for a body over the
limit) whose ``body()`` is the OpenAI error object ``{"error": {"message", "type", "param",
"code"}}``. Everything a client sends is checked for type and range and bounded: body size,
number of messages, stop strings, ``max_tokens``. Fields that OpenAI defines but sfchat cannot
honour (``n`` > 1, tools, logprobs, penalties) are refused only when they ask for something other
than the neutral default; unknown fields are refused, as OpenAI does.

``served_name(model)`` is the name a ``--model`` value is served under: a hub id as it is, a
local directory by its own name, never its path. ``same_model(served, asked)`` says whether a
request's ``model`` names it: the same last part in any case, and the same owner when both
name one (``qwen2.5-7b-instruct`` and ``Qwen/Qwen2.5-7B-Instruct`` do; ``other/Qwen2.5-7B-Instruct``
does not).

``completion``, ``chunk`` and ``usage`` build the response objects. ``finish_reason`` maps
sfchat's reasons (eos, length, context) onto OpenAI's (stop, length). sfchat's own figures go
in an extra ``"sfchat"`` field, which OpenAI clients keep as an unknown attribute.

Pure Python: no torch, no web framework; ``served_name`` looks at the file system.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from sfchat.params import BOUNDS, GenParams

ROLES = {"system", "developer", "user", "assistant"}
MAX_STOPS = 4
MAX_STOP_CHARS = 256


class ApiError(Exception):
    """A request refused with an OpenAI-style error object."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, *,
                 close: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.close = close  # answer with Connection: close (the body may be unread)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_body_bytes: int = 1 << 20
    max_messages: int = 256
    max_tokens: int = 4096  # the most tokens one reply may ask for (the server passes its context window)


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict, ...]  # {"role": ..., "content": str}; "developer" is given as "system"
    model: str | None = None
    max_tokens: int | None = None  # None: the server's --max-new-tokens
    # temperature, top_p, seed; top_k and repetition_penalty as vLLM's extensions (generate()'s, not
    # OpenAI's penalties): each None for the server's flag, else the model's own default
    gen: GenParams = GenParams()
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage


# fields OpenAI defines that sfchat accepts only at their neutral value: name -> is it neutral?
NEUTRAL = {
    "n": lambda v: v == 1,
    "presence_penalty": lambda v: v == 0,
    "frequency_penalty": lambda v: v == 0,
    "logprobs": lambda v: v is False,
    "top_logprobs": lambda v: v == 0,
    "logit_bias": lambda v: v == {},
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "parallel_tool_calls": lambda v: isinstance(v, bool),
    "response_format": lambda v: v == {"type": "text"},
    "user": lambda v: isinstance(v, str) and len(v) <= 256,
    "store": lambda v: v is False,
    "metadata": lambda v: isinstance(v, dict) and len(v) <= 16,
    "service_tier": lambda v: isinstance(v, str) and len(v) <= 32,
}
HONOURED = {"messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed",
            "stop", "stream", "stream_options"}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param, "invalid_value" if param else None)


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"'{name}' must be a number", name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(f"'{name}' must be {'>' if lo_open else '>='} {lo} and <= {hi}, not {v}", name)
    return float(v)


def _gen(body: dict) -> GenParams:
    """The sampling values a request sets, each within ``params.BOUNDS``, checked in this order."""
    def number(name: str) -> float | None:
        return _number(body, name, BOUNDS[name].lo, BOUNDS[name].hi, lo_open=BOUNDS[name].above)

    def integer(name: str) -> int | None:
        return _integer(body, name, BOUNDS[name].lo, BOUNDS[name].hi)

    return GenParams(temperature=number("temperature"), top_p=number("top_p"), top_k=integer("top_k"),
                     repetition_penalty=number("repetition_penalty"), seed=integer("seed"))


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{name}' must be an integer", name)
    if not lo <= v <= hi:
        raise bad(f"'{name}' must be between {lo} and {hi}, not {v}", name)
    return v


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    param = f"messages[{i}].content"
    if c is None and m.get("role") == "assistant":
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: only text ones
        parts = []
        for part in c:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"{param}: only text content parts are supported", param)
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{param} must be a string or a list of text parts", param)


def _messages(v, limits: Limits) -> tuple[dict, ...]:
    if not isinstance(v, list) or not v:
        raise bad("'messages' must be a non-empty list", "messages")
    if len(v) > limits.max_messages:
        raise bad(f"'messages' has {len(v)} entries; at most {limits.max_messages} are accepted", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(sorted(ROLES))} (tool calls are not "
                      f"supported)", f"messages[{i}].role")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise bad(f"messages[{i}] has unsupported fields: {', '.join(sorted(extra))}", f"messages[{i}]")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m, i)})
    return tuple(out)


def _stops(v) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad(f"'stop' may hold at most {MAX_STOPS} strings", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(f"each stop string must have 1 to {MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


def parse_chat_request(raw: bytes, limits: Limits = Limits()) -> ChatRequest:
    """Validate a chat-completions body (see the module docstring); raises ApiError."""
    if len(raw) > limits.max_body_bytes:
        raise ApiError(413, f"the request body has {len(raw)} bytes; at most {limits.max_body_bytes} are accepted")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in sorted(set(body) - HONOURED):
        value = body[name]
        if name not in NEUTRAL:
            raise bad(f"unrecognized request argument: {name!r}", name)
        if value is not None and not NEUTRAL[name](value):
            raise bad(f"{name}={json.dumps(value)[:60]} is not supported by this server", name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("'stream_options' is only allowed with stream=true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"} or \
                not isinstance(options.get("include_usage", False), bool):
            raise bad("'stream_options' may only hold include_usage (true or false)", "stream_options")
        include_usage = options.get("include_usage", False)
    max_tokens = _integer(body, "max_tokens", 1, limits.max_tokens)
    max_completion = _integer(body, "max_completion_tokens", 1, limits.max_tokens)
    return ChatRequest(
        messages=_messages(body.get("messages"), limits), model=model,
        max_tokens=max_completion if max_completion is not None else max_tokens,
        gen=_gen(body), stop=_stops(body.get("stop")), stream=bool(stream), include_usage=include_usage)


# -- responses --------------------------------------------------------------------------------------
def finish_reason(reason: str) -> str:
    """sfchat's finish reason -> OpenAI's: a stop string or EOS is "stop", a budget or full context "length"."""
    return {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}.get(reason, reason)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion(cid: str, created: int, model: str, text: str, reason: str, use: dict, figures: dict) -> dict:
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason(reason)}],
            "usage": use, "sfchat": figures}


def chunk(cid: str, created: int, model: str, delta: dict | None, reason: str | None = None,
          figures: dict | None = None, use: dict | None = None) -> dict:
    """One ``chat.completion.chunk``; ``delta=None`` gives the usage-only chunk (no choices)."""
    out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                 "finish_reason": finish_reason(reason) if reason else None}]}
    if figures is not None:
        out["sfchat"] = figures
    if use is not None:
        out["usage"] = use
    return out


def served_name(model: str) -> str:
    """The name ``model`` (a ``--model`` value) is served under (see the module's contract)."""
    return os.path.basename(os.path.abspath(model)) if os.path.isdir(model) else model


def same_model(served: str, asked: str) -> bool:
    """Whether a request's ``model`` names the served model (see the module's contract)."""
    owner, base = _owner_and_base(served.lower())
    asked_owner, asked_base = _owner_and_base(asked.lower())
    return bool(asked_base) and asked_base == base and (not owner or not asked_owner or owner == asked_owner)


def _owner_and_base(name: str) -> tuple[str, str]:
    owner, _, base = name.replace("\\", "/").rstrip("/").rpartition("/")
    return owner, base


def model_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(model_id, created)]}


def model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "sfchat"}
