"""Text in and out of the head: tokenizer, chat template, the system prompt, EOS, detokenising.

Contract
--------
* The system prompt rule, the only one: a configured system prompt (``--system`` or the config
  file's ``system``) opens every conversation that does not begin with a system message of its
  own; a conversation that brings one (an API client's) keeps its own. ``with_system`` applies it.
* ``encode(tokenizer, messages, chat_template)`` is a conversation's prompt ids: through the
  model's chat template (with the generation prompt) when it has one and ``chat_template`` is
  on, else the contents joined.
* ``load_tokenizer`` / ``eos_ids`` read a model's tokenizer and end-of-sequence ids;
  ``TextStream`` decodes a reply incrementally without ever emitting half a character;
  ``make_sampling`` fixes one reply's sampling settings (a fresh random seed unless one is set).
Knows nothing of models or links.
"""

from __future__ import annotations

import secrets

from sfchat import UserError
from sfchat.model.source import ModelSource
from sfchat.protocol.wire import Sampling


def with_system(messages: list[dict], system: str | None) -> list[dict]:
    """``messages`` under the system prompt rule (see the module's contract)."""
    if system and not (messages and messages[0].get("role") == "system"):
        return [{"role": "system", "content": system}] + list(messages)
    return list(messages)


def encode(tokenizer, messages: list[dict], chat_template: bool = True) -> list[int]:
    """Token ids of a conversation (through the chat template when the tokenizer has one)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer("".join(m["content"] for m in messages))["input_ids"]


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


def make_sampling(temperature: float, top_k: int, top_p: float, seed: int | None) -> Sampling:
    """Sampling settings of one reply; without a seed every reply draws fresh randomness."""
    return Sampling(float(temperature), int(top_k), float(top_p),
                    secrets.randbits(63) if seed is None else int(seed) & (2 ** 64 - 1))
