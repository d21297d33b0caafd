"""What the engine's tests share: a prompt, generate()'s greedy reply to it, and the engine's
reply through the head."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from sfchat.events import ReplyStarted, TokensCommitted
from sfchat.protocol.wire import Sampling


PROMPT = [{"role": "user", "content": "hello world, how are you?"}]
N_NEW = 32

_reference_cache: dict = {}


def reference(path, ids, n, eos=None, repetition_penalty=1.0):
    """The whole target model's greedy generate() continuation."""
    key = (str(path), tuple(ids), n, eos, repetition_penalty)
    if key not in _reference_cache:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos if eos is not None else model.generation_config.eos_token_id,
                             pad_token_id=0, repetition_penalty=repetition_penalty)
        _reference_cache[key] = out[0, len(ids):].tolist()
    return _reference_cache[key]


def run(session, ids, n=N_NEW):
    events = list(session.reply(ids, n, Sampling()))
    assert isinstance(events[0], ReplyStarted)
    rounds = events[1:-1]
    assert all(isinstance(e, TokensCommitted) for e in rounds)
    fin = events[-1]
    # Each round commits its accepted drafts plus one; only the last may stop short (EOS, limit).
    assert all(r.stats.committed == r.stats.accepted + 1 == len(r.token_ids) for r in rounds[:-1])
    assert 1 <= rounds[-1].stats.committed <= rounds[-1].stats.accepted + 1
    assert [t for r in rounds for t in r.token_ids] == list(fin.token_ids)
    # The histogram accounts for the tokens: (accepted + 1) per round, less the last round's cut.
    full = sum((a + 1) * count for a, count in enumerate(fin.accepted_histogram))
    assert 0 <= full - len(fin.token_ids) <= session.engine.spec.frame_size
    return fin
