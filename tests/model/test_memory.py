"""The memory estimate per GPU and its refusal (with the GPUs' free memory faked): weights, K/V,
workspace and graphs per GPU, the 2+2 T4 layouts, where the draft goes and how layers balance;
--device lists, the draft's default GPU, and a slice spread over two devices (run on the CPU).
The graphs themselves: test_graph_memory.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from sfchat import UserError
from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.model import memory
from sfchat.model.footprint import GIB, Need, device_bytes, slice_need, slice_needs
from sfchat.model.kv import draft_slots
from sfchat.model.memory import (DraftPlan, check_fits, check_head, check_tail, draft_need, head_plan, head_reserve,
                                 place_draft, tail_plan)
from sfchat.model.quant import NF4_BYTES_PER_WEIGHT
from sfchat.node.head import Head
from sfchat.model.decoder import layer_bytes
from sfchat.model.devices import default_draft_device, resolve_devices
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.protocol.wire import Sampling

from memory_configs import T4S, T4_FREE, gpus, qwen05b, qwen32b, qwen72b, qwen7b  # noqa: F401  (fixture)

CTX = 4096 + 8 + 1


def qwen14b():
    return Qwen2Config(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                       num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False)


AUTO = [(64, True)]  # --tree-budget auto on a GPU: one frame of 63 drafts and the root


def draft_plan(device, quant="none", **kw):
    shape = dict(rows=9, children=8, pool=321)
    return DraftPlan(qwen05b(), torch.device(device), torch.float16, quant, **(shape | kw))


def test_the_arithmetic_of_a_qwen7b_head():
    cfg = qwen7b()
    H, I, kvd = 3584, 18944, 4 * 128
    linear = H * H + 2 * H * kvd + H * H + 3 * H * I  # q, k, v, o, gate/up/down
    other = H + 2 * kvd + 2 * H  # q/k/v biases and the two norms
    need = slice_need(cfg, 0, 14, embed=True, head=False, dtype=torch.float16, quant="none", max_len=CTX,
                      verifies=[(9, False)])
    assert need.weights == 14 * (linear + other) * 2 + 152064 * H * 2
    assert need.kv == 2 * 14 * 4 * 128 * CTX * 2
    assert 0.5 * GIB < need.work < 1.5 * GIB  # a 512-token prefill chunk over 4105 slots
    assert len(need.graphs) == 5  # the 9-token verify, one graph per window (512 ... 4096, 4105)
    nf4 = slice_need(cfg, 0, 14, embed=True, head=False, dtype=torch.float16, quant="nf4", max_len=CTX,
                     verifies=[(9, False)])
    assert nf4.weights == int(14 * (linear * NF4_BYTES_PER_WEIGHT + other * 2) + 152064 * H * 2)
    assert nf4.kv == need.kv and nf4.work >= need.work >= 152064 * H * 2  # the bf16 embedding beside its fp16 copy
    assert max(g.temporaries for g in nf4.graphs) > max(g.temporaries for g in need.graphs) + 18944 * H * 2 - 1
    tail = slice_need(cfg, 14, 28, embed=False, head=True, dtype=torch.float16, quant="none", max_len=CTX,
                      verifies=[(9, False)])
    assert tail.weights == 14 * (linear + other) * 2 + (152064 * H + H) * 2  # lm_head and the final norm
    assert all(g.outputs == 9 * 152064 * 4 for g in tail.graphs)  # each graph keeps its float logits
    assert 7.0 * GIB < need.weights < 7.8 * GIB  # about half of the 15.2 GB checkpoint


def test_a_tied_whole_model_counts_its_embedding_once(zoo):
    """... and holds it once: converted to another dtype while loading (fp16 on a T4, from a bf16
    checkpoint; here from fp32), the lm_head is the embedding's weight, unless on another device."""
    src = ModelSource.open(str(zoo["qwen2-tied"]))
    cpu = torch.device("cpu")
    one = ModelSlice.load(src, 0, 4, embed=True, head=True, dtype=torch.float16, device=cpu, max_len=8)
    assert one.lm_head.weight is one.embed_tokens.weight
    two = ModelSlice.load(src, 0, 4, embed=True, head=True, dtype=torch.float16, device=cpu, max_len=8,
                          devices=[cpu, torch.device("cpu:0")])
    assert two.lm_head.weight is not two.embed_tokens.weight and torch.equal(two.lm_head.weight,
                                                                                 two.embed_tokens.weight)
    cfg = qwen05b()
    need = slice_need(cfg, 0, 24, embed=True, head=True, dtype=torch.float16, quant="none", max_len=CTX)
    assert 0.9 * GIB < need.weights < 1.0 * GIB  # 494M parameters
    [(_, a), (_, b)] = slice_needs(cfg, 0, 24, embed=True, head=True, dtype=torch.float16, quant="none",
                                   max_len=CTX, devices=T4S)
    assert a.weights + b.weights - need.weights == 151936 * 896 * 2  # spread: the lm_head copy on cuda:1


def test_the_reference_layouts_on_t4_pairs(gpus):
    # Qwen2.5-7B fp16 split in half, the 0.5B draft on the head's second T4: fits
    check_head(qwen7b(), 14, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="none", max_len=CTX,
               verifies=AUTO, draft=draft_plan("cuda:1"))
    check_tail(qwen7b(), 14, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="none", max_len=CTX,
               verifies=AUTO)
    # Qwen2.5-14B: fp16 does not fit one T4 per node; NF4 does, with room to spare
    with pytest.raises(UserError, match=r"not enough GPU memory on cuda:0: .*head layers .*--load-in-4bit"):
        check_head(qwen14b(), 24, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="none",
                   max_len=CTX, verifies=AUTO)
    check_head(qwen14b(), 24, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="nf4", max_len=CTX,
               verifies=AUTO, draft=draft_plan("cuda:1"))
    check_tail(qwen14b(), 24, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="nf4", max_len=CTX,
               verifies=AUTO)
    # ... or fp16 spread over the tail's two T4s
    check_tail(qwen14b(), 24, devices=T4S, dtype=torch.float16, quant="none", max_len=CTX, verifies=AUTO)


def test_2_plus_2_t4s_each_gpu_with_its_share(gpus):
    """Qwen2.5-32B NF4 over two notebooks of two T4s: each node spreads its half over its GPUs, the
    head's layers balanced around the draft; every GPU counts its own weights (the embedding on the
    head's first, the lm_head on the tail's last), K/V, workspace and graphs."""
    plan = head_plan(qwen32b(), 32, devices=T4S, dtype=torch.float16, quant="nf4", max_len=CTX, verifies=AUTO,
                     draft=draft_plan("cuda:1"))
    assert [(what, str(d)) for what, d, _ in plan] == [("head layers (part 1 of 2)", "cuda:0"),
                                                       ("head layers (part 2 of 2)", "cuda:1"), ("draft", "cuda:1")]
    layer = layer_bytes(qwen32b(), torch.float16, "nf4")
    totals = {d: total for d, (total, _) in memory.per_device(plan).items()}
    assert abs(totals[T4S[0]] - totals[T4S[1]]) < 1.5 * layer  # balanced to within a layer or so
    assert plan[0][2].weights - 152064 * 5120 * 2 < plan[1][2].weights  # fewer layers beside the embedding
    # 5 graphs per segment: the 64-node frame, per window; the draft's 10: its step, greedy and sampled, per
    # window that holds its pool (compiled or not)
    assert [len(n.graphs) for _, _, n in plan] == [5, 5, 10]
    check_head(qwen32b(), 32, devices=T4S, dtype=torch.float16, quant="nf4", max_len=CTX, verifies=AUTO,
               draft=draft_plan("cuda:1"))
    tail = tail_plan(qwen32b(), 32, devices=T4S, dtype=torch.float16, quant="nf4", max_len=CTX, verifies=AUTO)
    assert tail[1][2].weights > tail[0][2].weights  # the lm_head's GPU ...
    assert tail[1][2].weights - 152064 * 5120 * 2 < tail[0][2].weights  # ... with fewer layers
    check_tail(qwen32b(), 32, devices=T4S, dtype=torch.float16, quant="nf4", max_len=CTX, verifies=AUTO)
    # Qwen2.5-72B's tail on one T4 does not fit, and the refusal says to spread it
    with pytest.raises(UserError, match=r"--device cuda:0,cuda:1 on the tail"):
        check_tail(qwen72b(), 40, devices=T4S[:1], dtype=torch.float16, quant="nf4", max_len=CTX, verifies=AUTO)


def test_the_draft_goes_where_the_estimate_leaves_most_room(gpus):
    target = dict(devices=T4S, dtype=torch.float16, quant="nf4", max_len=CTX, verifies=AUTO)
    chosen = place_draft(qwen32b(), 32, draft_plan("cuda:1"), **target).device
    assert chosen in T4S
    room = {}
    for d in T4S:  # what each choice leaves on the fuller of the two GPUs
        needs = memory.per_device(head_plan(qwen32b(), 32, draft=draft_plan(d), **target))
        room[d] = min(gpus[g.index] - needs[g][0] for g in T4S)
    assert room[chosen] == max(room.values())
    # one GPU only: nothing to choose
    one = dict(target, devices=T4S[:1])
    assert place_draft(qwen32b(), 32, draft_plan("cuda:0"), **one).device == torch.device("cuda:0")
    # the head's layers are balanced around the draft: what it adds is reserved on its GPU
    reserve = head_reserve(draft_plan("cuda:1"), T4S, CTX)
    need = draft_need(draft_plan("cuda:1"), CTX)
    assert reserve[0] == 0 and need.weights + need.kv < reserve[1] < need.total
    # the draft's cache as the head loads it: whole blocks of its attention (4105 slots -> 4224)
    assert draft_slots(CTX) == 4224 and need.kv == draft_need(draft_plan("cuda:1"), 4224).kv > \
        draft_need(draft_plan("cuda:1"), 4096).kv


def test_layers_move_off_a_gpu_that_has_less_free(gpus):
    """Something else holds 3 GiB on cuda:0: the layers balance so that both GPUs keep about the
    same headroom, on the head (around the draft) and on the tail (by weights: the lm_head's GPU
    also holds the larger logits workspace and graph outputs, a few hundred MiB)."""
    target = dict(devices=T4S, dtype=torch.float16, quant="nf4", max_len=CTX, verifies=AUTO)
    layer = layer_bytes(qwen32b(), torch.float16, "nf4")
    for plan_of in (lambda: head_plan(qwen32b(), 32, draft=draft_plan("cuda:1"), **target),
                    lambda: tail_plan(qwen32b(), 32, **target)):
        gpus[0] = gpus[1] = T4_FREE
        even = [n.weights for _, _, n in plan_of()[:2]]
        gpus[0] = T4_FREE - 3 * GIB
        skewed = [n.weights for _, _, n in plan_of()[:2]]
        assert skewed[0] < even[0] - 4 * layer and skewed[1] > even[1] + 4 * layer
        left = [gpus[d.index] - total for d, (total, _) in memory.per_device(plan_of()).items()]
        assert abs(left[0] - left[1]) < 0.75 * GIB


def test_the_refusal_names_the_figures_and_the_fixes(gpus):
    gpus[0] = 6 * GIB
    with pytest.raises(UserError) as err:
        check_head(qwen7b(), 14, devices=[torch.device("cuda")], dtype=torch.float16, quant="none", max_len=CTX,
                   verifies=[(9, False)], draft=draft_plan("cuda", rows=2, children=1, pool=46))
    msg = str(err.value)
    assert msg.startswith("not enough GPU memory on cuda:0: loading needs about ")
    assert "head layers 9.2 GiB (weights 7.1 GiB" in msg and "5 CUDA graphs" in msg and "only 6.0 GiB is free" in msg
    assert "draft 2.0 GiB (weights 0.9 GiB" in msg and "10 CUDA graphs" in msg  # its step, greedy and sampled, per window
    for fix in ("--load-in-4bit", "a shorter --max-context (now 4105 positions, 0.03 GiB of KV cache per 1024 "
                "positions)",
                "a smaller --split (moves layers to the tail)", "--device cuda:0,cuda:1",
                "--draft-load-in-4bit, --draft-device on the other GPU, --draft none (the draft)",
                "SFCHAT_NO_MEMORY_CHECK=1"):
        assert fix in msg, fix
    assert "--tree-budget" not in msg and "--k" not in msg

    with pytest.raises(UserError) as err:
        check_tail(qwen7b(), 14, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="none", max_len=CTX,
                   verifies=AUTO)
    msg = str(err.value)
    assert "tail layers" in msg and "--load-in-4bit on the head" in msg and "5 CUDA graphs" in msg
    assert "a larger --split on the head (moves layers to the head)" in msg and "--split (moves layers to the tail)" \
        not in msg
    assert "a smaller --tree-budget on the head (now 63" in msg


def test_what_torch_holds_unused_counts_as_free_and_the_check_can_be_skipped(gpus, monkeypatch):
    need = Need(weights=5 * GIB, kv=0, work=0)
    gpus[0] = 4 * GIB
    with pytest.raises(UserError, match="only 4.0 GiB is free"):
        check_fits([("x", torch.device("cuda:0"), need)], [])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 5 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 1 * GIB)
    check_fits([("x", torch.device("cuda:0"), need)], [])  # 4 free + 4 cached = 8 GiB
    gpus[0] = 1 * GIB
    monkeypatch.setenv("SFCHAT_NO_MEMORY_CHECK", "1")
    check_fits([("x", torch.device("cuda:0"), need)], [])
    monkeypatch.delenv("SFCHAT_NO_MEMORY_CHECK")
    check_fits([("x", torch.device("cpu"), Need(10 ** 15, 0, 0))], [])  # the CPU is never checked


def test_device_lists_and_the_default_draft_device(gpus):
    assert resolve_devices(None) == [torch.device("cuda")]
    assert resolve_devices("cuda:0,cuda:1") == [torch.device("cuda:0"), torch.device("cuda:1")]
    with pytest.raises(UserError, match="names the same GPU twice"):
        resolve_devices("cuda:0,cuda:0")
    with pytest.raises(UserError, match=r"spread over GPUs \(cuda:0,cuda:1\) or run as segments on the CPU"):
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
    assert model.devices == two and model.ranges == [(0, 2), (2, 4)]
    assert model.last_device == two[1]
    assert len(model.kv_tensors()) == 2 * 4  # keys and values of each layer, in its segment's cache
    assert [layer.self_attn.layer_idx for layer in model.layers] == [0, 1, 0, 1]
    assert model.capture(9, 9, log=lambda m: None) is False
    ids = [1, 17, 42, 99, 5, 250, 7, 300]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path).eval()(torch.tensor([ids])).logits[0]
    out = model(torch.tensor(ids[:5]), torch.arange(5), n_logits=5)
    out = torch.cat([out, model(torch.tensor(ids[5:]), torch.arange(5, 8), n_logits=3)])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert model.kv_tensors()[4][0, :, :8].abs().sum() > 0  # the second segment's first keys were written


def test_engine_parity_with_a_spread_target(zoo, monkeypatch):
    path = zoo["llama-untied"]
    import sfchat.node.loading as session_mod

    real = session_mod.resolve_devices
    monkeypatch.setattr(session_mod, "resolve_devices",
                        lambda name: [torch.device("cpu"), torch.device("cpu:0")] if name == "two" else real(name))
    monkeypatch.setattr(session_mod, "resolve_device", lambda name: torch.device("cpu"))
    session = Head.open(Settings(model=str(path), draft=str(zoo["draft"]), k=3, device="two"))
    assert len(session.engine.head.devices) == 2 and len(session.engine.link.verifier.model.devices) == 2
    ids = session.encode([{"role": "user", "content": "hello world"}])
    fin = [e for e in session.reply(ids, 16, Sampling()) if isinstance(e, ReplyFinished)][0]
    ref = AutoModelForCausalLM.from_pretrained(path).eval().generate(torch.tensor([ids]), max_new_tokens=16,
                                                                      do_sample=False, pad_token_id=0)
    assert list(fin.token_ids) == ref[0, len(ids):].tolist()


def test_a_tree_budget_that_does_not_fit_is_refused_with_its_figures(gpus):
    """The tail's logits grow with the tree: a 7B tail half on a T4 fits the chain of 8 and a
    64-node tree, and is refused a 256-node tree (rows of logits, and the graphs that keep them),
    naming the budget as a fix."""
    def scratch_slots(k, budget, vocab):  # the head's pool of four frames in flight, and the trash slot
        return 5 * (budget + 1) + 1

    def verifies(budget):
        return [(budget + 1, True)] if budget else [(9, True)]

    def need(budget):
        return device_bytes(n for _, _, n in tail_plan(qwen7b(), 14, devices=[torch.device("cuda:0")],
                                                       dtype=torch.float16, quant="none", verifies=verifies(budget),
                                                       max_len=4096 + scratch_slots(8, budget, 152064)))

    chain, tree64, tree256 = need(0), need(64), need(256)
    assert chain < tree64 < tree256
    assert tree256 - tree64 > 5 * 192 * 152064 * 4  # five windows' graphs keep 192 more rows of float logits
    gpus[0] = tree64 + (1 << 20)
    for budget in (0, 64):
        check_tail(qwen7b(), 14, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="none",
                   max_len=4096 + scratch_slots(8, budget, 152064), verifies=verifies(budget))
    with pytest.raises(UserError) as err:
        check_tail(qwen7b(), 14, devices=[torch.device("cuda:0")], dtype=torch.float16, quant="none",
                   max_len=4096 + scratch_slots(8, 256, 152064), verifies=verifies(256))
    msg = str(err.value)
    assert "not enough GPU memory on cuda:0" in msg and "tail layers" in msg
    assert "a smaller --tree-budget on the head (now 256" in msg
