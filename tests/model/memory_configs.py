"""Model configs of the sizes the memory estimate is checked on, and GPUs to check them on."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from sfchat.model.footprint import GIB


T4_FREE = int(14.5 * GIB)  # what a 15 GB T4 has free once CUDA is up


def qwen7b():
    return Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)


def qwen32b():
    return Qwen2Config(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                       num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False)


def qwen72b():
    return Qwen2Config(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False)


def qwen05b():
    return Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)


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
