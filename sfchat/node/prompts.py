"""Text in and out of the head: tokenizer, chat template, the system prompt, EOS, detokenising.

Contract
--------
* The system prompt rule, the only one: a configured system prompt (``--system`` or the config
  file's ``system``) opens every conversation that does not begin with a system message of its
  own; a conversation that brings one (an API client's) keeps its own. ``with_system`` applies it.
* ``encode(tokenizer, messages, chat_template)`` is a conversation's prompt ids: through the
  model's chat template (with the generation prompt) when it has one and ``chat_template`` is
  on, else the contents joined. Text a person or a client wrote never becomes a control token:
  the text of any added token inside a message, special (``<|im_end|>``, ``<|im_start|>``...) or
  not (Qwen's ``<tool_call>``, ``</think>``), is tokenized as the plain text it is, while the
  tokens the template writes stay what they are. A conversation without such text gives exactly
  the ids of the rendered template tokenized as a whole.
* Rendering is bounded: a template that runs past ``RENDER_SECONDS`` or makes more than
  ``RENDER_CHARS`` characters (in its output or in any one value) is stopped with a
  ``TemplateError`` (a ``UserError``) that says so. The bound is checked at every step of
  Python code the rendering runs on the calling thread; a single operation in C (one huge string
  repetition) is not interrupted.
* ``load_tokenizer`` / ``eos_ids`` read a model's tokenizer and end-of-sequence ids;
  ``TextStream`` decodes a reply incrementally without ever emitting half a character;
  ``make_sampling`` fixes one reply's sampling settings (a fresh random seed unless one is set;
  a temperature below ``GREEDY_BELOW`` is served as greedy, the limit sampling tends to there).
Knows nothing of models or links.
"""

from __future__ import annotations

import inspect
import re
import secrets
import sys
import time

from sfchat import UserError
from sfchat.model.source import ModelSource
from sfchat.protocol.wire import Sampling

RENDER_SECONDS = 5.0  # a chat template renders in milliseconds; one that runs for seconds loops
RENDER_CHARS = 1 << 23  # 8 Mi characters: far past any conversation that fits a context window
GREEDY_BELOW = 1e-5  # float32 logits divided by a smaller temperature can overflow to inf


class TemplateError(UserError):
    """The chat template ran too long or made too much text."""


class _Overrun(BaseException):
    """Raised inside the rendering by the bound; a BaseException, so that no ``except Exception``
    in the template engine swallows it."""


def with_system(messages: list[dict], system: str | None) -> list[dict]:
    """``messages`` under the system prompt rule (see the module's contract)."""
    if system and not (messages and messages[0].get("role") == "system"):
        return [{"role": "system", "content": system}] + list(messages)
    return list(messages)


def encode(tokenizer, messages: list[dict], chat_template: bool = True) -> list[int]:
    """Token ids of a conversation (through the chat template when the tokenizer has one)."""
    added = _added(tokenizer)
    if not (chat_template and getattr(tokenizer, "chat_template", None)):
        text = "".join(m["content"] for m in messages)
        if added is None:
            return tokenizer(text, split_special_tokens=True)["input_ids"]
        ids = tokenizer("", add_special_tokens=True)["input_ids"]  # what the tokenizer puts first, if anything
        for i, piece in enumerate(added.split(text)):
            ids += _as_text(tokenizer, piece) if i % 2 else tokenizer(piece, add_special_tokens=False)["input_ids"]
        return ids
    marker = f"\ue000{secrets.randbelow(10 ** 12):012d}:"  # fresh each time: no message can hold it
    typed: list[str] = []  # added tokens' text found in the messages, by marker number

    def mark(match: re.Match) -> str:
        typed.append(match.group())
        return f"{marker}{len(typed) - 1}\ue001"

    marked = [{**m, "content": added.sub(mark, m["content"])} if added and isinstance(m.get("content"), str)
              else m for m in messages]
    text = render(tokenizer, marked)
    if not typed:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    for i, piece in enumerate(re.split(re.escape(marker) + "([0-9]+)\ue001", text)):
        if i % 2:  # an added token's text that a message held: plain text
            ids += _as_text(tokenizer, typed[int(piece)])
        elif piece:  # the template's text (its special tokens are control tokens) and plain message text
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


def _added(tokenizer) -> re.Pattern | None:
    """A pattern capturing the text of every added token, special or not (the longest first), or None."""
    texts = {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    texts |= set(getattr(tokenizer, "all_special_tokens", ()))
    texts.discard("")
    return re.compile("(" + "|".join(map(re.escape, sorted(texts, key=len, reverse=True))) + ")") if texts else None


def _as_text(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` as the characters it is, never as an added token: a tokenizer parses
    non-special added tokens even with ``split_special_tokens``, so such text is cut in two."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if len(text) < 2 or not set(ids) & set(getattr(tokenizer, "added_tokens_decoder", {})):
        return ids
    return _as_text(tokenizer, text[:1]) + _as_text(tokenizer, text[1:])


def render(tokenizer, messages: list[dict]) -> str:
    """The chat template applied to ``messages`` (with the generation prompt), under the bound."""
    bound = _Bound(RENDER_SECONDS, RENDER_CHARS)
    previous = sys.gettrace()
    sys.settrace(bound)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except _Overrun as exc:
        raise TemplateError(f"the chat template {exc}: a template that loops or grows without end cannot "
                            f"render this conversation") from None
    finally:
        sys.settrace(previous)
    if len(text) > RENDER_CHARS:
        raise TemplateError(f"the chat template made {len(text)} characters; at most {RENDER_CHARS} are accepted")
    return text


class _Bound:
    """The trace function of one rendering: the deadline and the size limits, checked at every
    call, line and return of Python code on this thread until ``sys.settrace`` is restored."""

    def __init__(self, seconds: float, chars: int):
        self.seconds, self.chars = seconds, chars
        self.deadline = time.monotonic() + seconds
        self.steps = self.output = 0

    def __call__(self, frame, event: str, arg):
        self.steps += 1
        if not self.steps & 63 and time.monotonic() > self.deadline:
            raise _Overrun(f"ran for more than {self.seconds:g} s")
        template = frame.f_code.co_filename == "<template>"
        if event == "return" and isinstance(arg, str):  # values returned, and the text a template yields
            self._check(arg)
            if template and frame.f_code.co_flags & inspect.CO_GENERATOR:
                self.output += len(arg)
                if self.output > self.chars:
                    raise _Overrun(f"made more than {self.chars} characters")
        elif event == "line" and template:  # values made in C and kept in a template variable
            for value in frame.f_locals.values():
                self._check(value)
        return self

    def _check(self, value) -> None:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.chars:
            raise _Overrun(f"made a value of more than {self.chars} items")


def load_tokenizer(src: ModelSource, revision: str | None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src.tokenizer_location, revision=revision, trust_remote_code=False,
                                             local_files_only=src.local_files_only)
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"cannot load the tokenizer of {src.name!r}: {exc}") from None


def eos_ids(src: ModelSource, tokenizer) -> set[int]:
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        gen = GenerationConfig.from_pretrained(src.tokenizer_location, revision=src.revision,
                                               local_files_only=src.local_files_only)
        eos = gen.eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class TextStream:
    """Incremental detokenisation that never emits half of a multi-byte character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def push(self, ids, final: bool = False) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:  # wait for the rest of the character
            return ""
        delta = text[len(self.text):] if text.startswith(self.text) else text
        self.text = text
        return delta


def make_sampling(temperature: float, top_k: int, top_p: float, seed: int | None,
                  repetition_penalty: float = 1.0) -> Sampling:
    """Sampling settings of one reply; without a seed every reply draws fresh randomness. A
    temperature below ``GREEDY_BELOW`` is greedy: sampling there is the argmax but for near ties, and
    float32 logits divided by it may overflow."""
    t = float(temperature)
    return Sampling(0.0 if t < GREEDY_BELOW else t, int(top_k), float(top_p),
                    secrets.randbits(63) if seed is None else int(seed) & (2 ** 64 - 1), float(repetition_penalty))
