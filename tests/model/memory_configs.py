"""Model configs of the sizes the memory estimate is checked on, and GPUs to check them on."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import Qwen2Config

from sfchat.model.footprint import GIB


T4_FREE = int(14.5 * GIB)  # what a 15 GB T4 has free once CUDA is up


def qwen2(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int = 152064,
          tied: bool = False) -> Qwen2Config:
    """A Qwen2 config of that shape (no weights: all the estimate reads)."""
    return Qwen2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                       tie_word_embeddings=tied)


# Qwen2.5's shapes
qwen05b = functools.partial(qwen2, 896, 4864, 24, 14, 2, vocab=151936, tied=True)
qwen7b = functools.partial(qwen2, 3584, 18944, 28, 28, 4)
qwen32b = functools.partial(qwen2, 5120, 27648, 64, 40, 8)
qwen72b = functools.partial(qwen2, 8192, 29568, 80, 64, 8)


@pytest.fixture
def gpus(monkeypatch):
    """Fake CUDA devices: ``free[i]`` bytes free on cuda:i (set by the test), nothing cached by torch."""
    free = {0: T4_FREE, 1: T4_FREE}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(free))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free[torch.device(d).index], 15 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 0)
    monkeypatch.delenv("SFCHAT_NO_MEMORY_CHECK", raising=False)
    return free


T4S = [torch.device("cuda:0"), torch.device("cuda:1")]
