"""A draft's projections merged (``model.fused``): the same logits as transformers' own forward,
plain and tree forwards, every family; the same bytes; what is left alone and what is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from sfchat.engine.draft import Drafter
from sfchat.model import fused
from sfchat.model.decoder import n_layers
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.protocol.wire import Sampling

IDS = [1, 17, 42, 99, 5, 250, 7, 300, 64, 12, 88, 3]
NAMES = ["qwen2-untied", "qwen2-tied", "qwen3-untied", "llama-untied"]


def whole(path, max_len: int = 64) -> ModelSlice:
    src = ModelSource.open(str(path))
    return ModelSlice.load(src, 0, n_layers(src.config), embed=True, head=True, dtype=torch.float32,
                           device=torch.device("cpu"), max_len=max_len)


def logits(sl: ModelSlice, ids=IDS) -> torch.Tensor:
    sl.reset()
    return sl.forward(torch.tensor(ids), torch.arange(len(ids)), n_logits=len(ids))


@pytest.mark.parametrize("name", NAMES)
def test_fused_layers_give_transformers_logits(zoo, name):
    sl = whole(zoo[name])
    bytes_before = sum(p.numel() * p.element_size() for p in sl.parameters())
    assert sl.fuse_projections() == len(sl.layers)
    for layer in sl.layers:
        assert isinstance(layer.self_attn, fused.FusedAttention) and isinstance(layer.mlp, fused.FusedMLP)
        assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    assert sum(p.numel() * p.element_size() for p in sl.parameters()) == bytes_before
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(zoo[name]).eval()(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(logits(sl), want, rtol=1e-5, atol=1e-5)
    if name.startswith("qwen2"):  # the family with q/k/v biases: they were stacked too
        assert sl.layers[0].self_attn.qkv_proj.bias is not None


@pytest.mark.parametrize("name", ["qwen2-untied", "qwen3-tied", "llama-tied"])
def test_a_fused_draft_proposes_what_the_unfused_one_does(zoo, name):
    """Tree forwards (the draft's steps: the scratch, the tree mask) through the merged layers, greedy
    and sampled, against the same draft with its layers as loaded."""
    plain = Drafter(whole(zoo[name], 256), width=4, children=6, pool=64, fuse=False)
    merged = Drafter(whole(zoo[name], 256), width=4, children=6, pool=64)
    assert not isinstance(plain.model.layers[0].self_attn, fused.FusedAttention)
    assert isinstance(merged.model.layers[0].self_attn, fused.FusedAttention)
    context = list(range(5, 45))
    for s in (Sampling(), Sampling(temperature=0.8, top_p=0.9)):
        out = []
        for d in (plain, merged):
            d.sync(context)
            first = d.expand([(7, 40, "a", []), (9, 40, "b", [])], s)
            second = d.expand([(first[0][0][0], 41, "c", ["a"]), (first[1][1][0], 41, "d", ["b"])], s)
            out.append(first + second)
            d.scratch.reset(len(context))
        for want, got in zip(*out):
            assert [t for t, _ in got] == [t for t, _ in want]
            torch.testing.assert_close(torch.tensor([p for _, p in got]), torch.tensor([p for _, p in want]),
                                       rtol=1e-5, atol=1e-6)


def test_layers_fused_once_and_only_plain_linears(zoo):
    sl = whole(zoo["llama-untied"])
    odd = type("Odd", (nn.Linear,), {})  # a subclass stands for bitsandbytes' 4-bit and int8 linears
    attn = sl.layers[1].self_attn
    q = odd(attn.q_proj.in_features, attn.q_proj.out_features, bias=False)
    q.weight = attn.q_proj.weight
    attn.q_proj = q
    assert sl.fuse_projections() == len(sl.layers) - 1
    assert sl.layers[1].self_attn is attn  # left as it was, and it still runs
    assert sl.fuse_projections() == 0  # nothing twice
    assert torch.isfinite(logits(sl)).all()


def test_a_target_slice_or_a_captured_one_is_not_fused(zoo):
    src = ModelSource.open(str(zoo["qwen2-untied"]))
    one_shape = ModelSlice.load(src, 0, 2, embed=True, head=False, dtype=torch.float32, device=torch.device("cpu"),
                                max_len=64, rows=8)
    with pytest.raises(ValueError, match="draft's slice"):
        one_shape.fuse_projections()
    sl = whole(zoo["qwen2-untied"])
    sl.graphs._graphs[(9, 1, False, 0)] = {64: object()}  # stands for a graph captured over the layers as loaded
    assert sl.graphs
    with pytest.raises(ValueError, match="before its graphs"):
        sl.fuse_projections()
