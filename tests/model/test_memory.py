"""The memory estimate and its refusal (with the GPU's free memory faked), and the device layouts:
--device lists, the draft's default GPU, and a slice spread over two devices (run on the CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from sfchat import UserError
from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.model import memory
from sfchat.model.memory import GIB, Need, check_fits, check_head, check_tail, slice_need
from sfchat.model.quant import NF4_BYTES_PER_WEIGHT
from sfchat.node.head import Head
from sfchat.model.devices import default_draft_device, resolve_devices
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.protocol.wire import Sampling

T4_FREE = int(14.5 * GIB)  # what a 15 GB T4 has free once CUDA is up
CTX = 4096 + 8 + 1


def qwen7b():
    return Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)


def qwen14b():
    return Qwen2Config(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
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


def test_the_arithmetic_of_a_qwen7b_head():
    cfg = qwen7b()
    H, I, kvd = 3584, 18944, 4 * 128
    linear = H * H + 2 * H * kvd + H * H + 3 * H * I  # q, k, v, o, gate/up/down
    other = H + 2 * kvd + 2 * H  # q/k/v biases and the two norms
    need = slice_need(cfg, 0, 14, embed=True, head=False, dtype=torch.float16, quant="none", max_len=CTX, k=8)
    assert need.weights == 14 * (linear + other) * 2 + 152064 * H * 2
    assert need.kv == 2 * 14 * 4 * 128 * CTX * 2
    assert memory.FIXED_SLACK + need.weights // 20 < need.work < 2 * GIB
    nf4 = slice_need(cfg, 0, 14, embed=True, head=False, dtype=torch.float16, quant="nf4", max_len=CTX, k=8)
    assert nf4.weights == int(14 * (linear * NF4_BYTES_PER_WEIGHT + other * 2) + 152064 * H * 2)
    assert nf4.kv == need.kv and nf4.work > need.work  # one dense layer in flight while quantising
    tail = slice_need(cfg, 14, 28, embed=False, head=True, dtype=torch.float16, quant="none", max_len=CTX, k=8)
    assert tail.weights == 14 * (linear + other) * 2 + (152064 * H + H) * 2  # lm_head and the final norm
    assert 7.0 * GIB < need.weights < 7.8 * GIB  # about half of the 15.2 GB checkpoint


def test_a_tied_whole_model_counts_its_embedding_once():
    cfg = qwen05b()
    need = slice_need(cfg, 0, 24, embed=True, head=True, dtype=torch.float16, quant="none", max_len=CTX, k=0)
    assert 0.9 * GIB < need.weights < 1.0 * GIB  # 494M parameters


def test_the_reference_layouts_on_t4_pairs(gpus):
    # Qwen2.5-7B fp16 split in half, the 0.5B draft on the head's second T4: fits
    check_head(qwen7b(), 14, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="none", max_len=CTX,
               k=8, draft=(qwen05b(), torch.device("cuda:1"), torch.float16, "none"))
    check_tail(qwen7b(), 14, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="none", max_len=CTX, k=8)
    # Qwen2.5-14B: fp16 does not fit one T4 per node; NF4 does, with room to spare
    with pytest.raises(UserError, match=r"not enough GPU memory on cuda:0: .*head layers .*--load-in-4bit"):
        check_head(qwen14b(), 24, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="none",
                   max_len=CTX, k=8)
    check_head(qwen14b(), 24, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="nf4", max_len=CTX,
               k=8, draft=(qwen05b(), torch.device("cuda:1"), torch.float16, "none"))
    check_tail(qwen14b(), 24, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="nf4", max_len=CTX, k=8)
    # ... or fp16 spread over the tail's two T4s
    check_tail(qwen14b(), 24, devices=[torch.device("cuda:0"), torch.device("cuda:1")], dtype=torch.float16,
               quant="none", max_len=CTX, k=8)


def test_the_refusal_names_the_figures_and_the_fixes(gpus):
    gpus[0] = 6 * GIB
    with pytest.raises(UserError) as err:
        check_head(qwen7b(), 14, devices=[torch.device("cuda")], dtype=torch.float16, quant="none", max_len=CTX,
                   k=8, draft=(qwen05b(), torch.device("cuda"), torch.float16, "none"))
    msg = str(err.value)
    assert msg.startswith("not enough GPU memory on cuda:0: loading needs about ")
    assert "head layers 8.8 GiB (weights 7.1 GiB" in msg and "draft 2.0 GiB" in msg and "only 6.0 GiB is free" in msg  # round + guess graphs
    for fix in ("--load-in-4bit", "a shorter --max-context (now 4105 positions, 0.03 GiB of KV cache per 1024 "
                "positions)",
                "a smaller --split (moves layers to the tail)", "--device cuda:0,cuda:1",
                "--draft-load-in-4bit, --draft-device on the other GPU, --draft none (the draft)",
                "SFCHAT_NO_MEMORY_CHECK=1"):
        assert fix in msg, fix

    with pytest.raises(UserError) as err:
        check_tail(qwen7b(), 14, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="none", max_len=CTX,
                   k=8)
    msg = str(err.value)
    assert "tail layers" in msg and "--load-in-4bit on the head" in msg
    assert "a larger --split on the head (moves layers to the head)" in msg and "--split (moves layers to the tail)" \
        not in msg


def test_what_torch_holds_unused_counts_as_free_and_the_check_can_be_skipped(gpus, monkeypatch):
    need = Need(weights=5 * GIB, kv=0, work=0)
    gpus[0] = 4 * GIB
    with pytest.raises(UserError, match="only 4.0 GiB is free"):
        check_fits([("x", [torch.device("cuda:0")], need)], [])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 1 * GIB)
    check_fits([("x", [torch.device("cuda:0")], need)], [])  # 4 free + 2 cached = 6 GiB
    gpus[0] = 1 * GIB
    monkeypatch.setenv("SFCHAT_NO_MEMORY_CHECK", "1")
    check_fits([("x", [torch.device("cuda:0")], need)], [])
    monkeypatch.delenv("SFCHAT_NO_MEMORY_CHECK")
    check_fits([("x", [torch.device("cpu")], Need(10 ** 15, 0, 0))], [])  # the CPU is never checked
    # a need spread over two GPUs is split between them; its workspace is needed on each
    gpus[0], gpus[1] = 3 * GIB, 3 * GIB
    check_fits([("x", [torch.device("cuda:0"), torch.device("cuda:1")], need)], [])


def test_device_lists_and_the_default_draft_device(gpus):
    assert resolve_devices(None) == [torch.device("cuda")]
    assert resolve_devices("cuda:0,cuda:1") == [torch.device("cuda:0"), torch.device("cuda:1")]
    with pytest.raises(UserError, match="names the same GPU twice"):
        resolve_devices("cuda:0,cuda:0")
    with pytest.raises(UserError, match="only GPUs can share a slice"):
        resolve_devices("cpu,cuda:0")
    with pytest.raises(UserError, match=r"device 'cuda:2' does not exist \(2 GPUs visible\)"):
        resolve_devices("cuda:0,cuda:2")
    # a T4 pair: the draft goes to the GPU the target slice does not use
    assert default_draft_device([torch.device("cuda")]) == torch.device("cuda:1")
    assert default_draft_device([torch.device("cuda:1")]) == torch.device("cuda:0")
    assert default_draft_device([torch.device("cuda:0"), torch.device("cuda:1")]) == torch.device("cuda:1")
    del gpus[1]
    assert default_draft_device([torch.device("cuda")]) == torch.device("cuda")
    assert default_draft_device([torch.device("cpu")]) == torch.device("cpu")


def test_a_slice_spread_over_two_devices(zoo):
    """Two distinct CPU devices ("cpu" and "cpu:0") exercise the two-GPU code path: one KV cache per
    device with local layer slots, the hidden states handed over, outputs back on the first device."""
    path = zoo["qwen2-untied"]
    src = ModelSource.open(str(path))
    two = [torch.device("cpu"), torch.device("cpu:0")]
    model = ModelSlice.load(src, 0, 4, embed=True, head=True, dtype=torch.float32, device=two[0], max_len=32,
                            devices=two)
    assert [dev for dev, _, _ in model.groups] == two and model.layer_devices == two[:1] * 2 + two[1:] * 2
    assert [len(kv.keys) for _, kv, _ in model.groups] == [2, 2]
    assert [layer.self_attn.layer_idx for layer in model.layers] == [0, 1, 0, 1]
    assert model.capture(9, 9, log=lambda m: None) is False
    ids = [1, 17, 42, 99, 5, 250, 7, 300]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path).eval()(torch.tensor([ids])).logits[0]
    out = model(torch.tensor(ids[:5]), torch.arange(5), n_logits=5)
    out = torch.cat([out, model(torch.tensor(ids[5:]), torch.arange(5, 8), n_logits=3)])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert model.groups[1][1].keys[0][0, :, :8].abs().sum() > 0  # the second device's cache was written


def test_engine_parity_with_a_spread_target(zoo, monkeypatch):
    path = zoo["llama-untied"]
    import sfchat.node.loading as session_mod

    real = session_mod.resolve_devices
    monkeypatch.setattr(session_mod, "resolve_devices",
                        lambda name: [torch.device("cpu"), torch.device("cpu:0")] if name == "two" else real(name))
    monkeypatch.setattr(session_mod, "resolve_device", lambda name: torch.device("cpu"))
    session = Head.open(Settings(model=str(path), draft=str(zoo["draft"]), k=3, device="two"))
    assert len(session.engine.head.groups) == 2 and len(session.engine.link.verifier.model.groups) == 2
    ids = session.encode([{"role": "user", "content": "hello world"}])
    fin = [e for e in session.reply(ids, 16, Sampling()) if isinstance(e, ReplyFinished)][0]
    ref = AutoModelForCausalLM.from_pretrained(path).eval().generate(torch.tensor([ids]), max_new_tokens=16,
                                                                      do_sample=False, pad_token_id=0)
    assert list(fin.token_ids) == ref[0, len(ids):].tolist()


def test_a_tree_budget_that_does_not_fit_is_refused_with_its_figures(gpus):
    """The tail's logits grow with the tree: a 7B tail half on a T4 fits the chain of 8 and a
    64-node tree, and is refused a 256-node tree (rows of logits), naming the budget as a fix."""
    from sfchat.engine.draft import scratch_slots

    def need(budget):
        return slice_need(qwen7b(), 14, 28, embed=False, head=True, dtype=torch.float16, quant="none",
                          max_len=4096 + scratch_slots(8, budget, 152064), k=max(8, budget))

    chain, tree64, tree256 = need(0), need(64), need(256)
    assert tree256.work - chain.work > 248 * 152064 * 14  # the extra rows of logits and their copies
    assert tree256.kv > chain.kv  # the scratch slots
    gpus[0] = chain.total + tree64.work - chain.work + (tree64.kv - chain.kv) + (1 << 20)
    for budget in (0, 64):
        check_tail(qwen7b(), 14, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="none",
                   max_len=4096 + scratch_slots(8, budget, 152064), k=8, tree_budget=budget)
    with pytest.raises(UserError) as err:
        check_tail(qwen7b(), 14, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="none",
                   max_len=4096 + scratch_slots(8, 256, 152064), k=8, tree_budget=256)
    msg = str(err.value)
    assert "not enough GPU memory on cuda:0" in msg and "tail layers" in msg
    assert "a smaller --tree-budget on the head (now 256" in msg
