"""Tiny random checkpoints and a trained tokenizer for the tests (no network needed).

``make_tokenizer(dir)`` trains a small byte-level BPE tokenizer with ChatML special tokens and
a chat template; ``make_model(dir, family, ...)`` saves a random Qwen2 / Qwen3 / Llama model of
a few layers with that tokenizer, as ``save_pretrained`` would for a real checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target verifies them in one pass",
    "a relay joins two machines that cannot reach each other",
    "hello world, how are you today? I am fine, thank you.",
    "numbers 0 1 2 3 4 5 6 7 8 9 and symbols ! ? . , ; : - + = ( ) [ ]",
    "Kaggle notebooks accept no inbound connections, so both nodes dial out",
] * 20


def make_tokenizer(path: Path, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token=None)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return tok


def config_for(family: str, vocab: int, *, layers: int = 4, hidden: int = 64, tied: bool = False,
               max_pos: int = 256):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                  tie_word_embeddings=tied, initializer_range=0.3, eos_token_id=2, bos_token_id=0,
                  pad_token_id=0)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    if family == "llama":
        return LlamaConfig(**common)
    raise ValueError(family)


def make_model(path: Path, family: str, tokenizer, *, seed: int = 0, max_shard_size: str | None = None, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = config_for(family, len(tokenizer), **kw)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **extra)
    tokenizer.save_pretrained(path)
    return model
