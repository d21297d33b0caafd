"""A decoder layer's projections merged: one GEMM for q/k/v and one for gate/up.

Contract
--------
``fuse(layer)`` rebuilds a loaded decoder layer of the Qwen2 / Qwen2.5, Qwen3 and Llama families
in place: its attention's ``q_proj``, ``k_proj`` and ``v_proj`` become one linear (their weights,
and biases where the family has them, stacked) whose output is split, and its MLP's
``gate_proj`` and ``up_proj`` one linear of twice the width. The rest is the family's own
modules and functions: the norms (Qwen3's per-head ``q_norm`` / ``k_norm`` included), its
``apply_rotary_pos_emb``, the attention function registered in the config, the cache's
``update``, ``o_proj`` and ``down_proj``. The stacked weights replace the separate ones (the
layer holds as many bytes as before; one layer's projections are held twice while it is fused).
It returns whether it fused anything: a layer whose projections are not plain ``nn.Linear`` of
one dtype and device (bitsandbytes' 4-bit and int8 layers, a half-loaded layer) is left as it
is, and a layer fused already is not fused again.

What it buys: at a draft's 9 rows every GEMM reads its weights in a few microseconds, so a step
costs its kernels' count more than its bytes; merging takes three kernels out of each layer (an
H100, a 0.5B draft compiled: a step of 2.08 ms against 2.46, bench/RESULTS.md, sixteenth session).
What it changes: the sums of a row's products are the same sums, but the GEMM kernel that a
wider matrix gets may order them differently, so the outputs equal the unfused layer's only up
to rounding (float32 on a CPU: within 1e-5). The draft's tokens are proposals the target
verifies, so that is harmless there; the target's slices are never fused (one answer whatever
the mode rests on their arithmetic staying the reference's).
"""

from __future__ import annotations

import sys

import torch
from torch import nn


def _plain(*linears) -> bool:
    first = linears[0]
    return all(type(m) is nn.Linear and not m.weight.is_meta and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
               for m in linears)


def _stacked(linears) -> nn.Linear:
    """One linear whose output is the outputs of ``linears`` side by side."""
    w = torch.cat([m.weight.detach() for m in linears])
    b = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
    out = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    out.weight = nn.Parameter(w, requires_grad=False)
    if b is not None:
        out.bias = nn.Parameter(b, requires_grad=False)
    return out


class FusedAttention(nn.Module):
    """The family's attention with q/k/v as one GEMM; the same attributes the attention
    function and the cache read from the module."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        for name in ("config", "layer_idx", "head_dim", "num_key_value_groups", "scaling", "attention_dropout",
                     "is_causal", "sliding_window", "layer_type"):
            if hasattr(attn, name):
                setattr(self, name, getattr(attn, name))
        self.sizes = [m.out_features for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
        self.qkv_proj = _stacked([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.q_norm = getattr(attn, "q_norm", None)  # Qwen3: RMS norms over each head
        self.k_norm = getattr(attn, "k_norm", None)
        family = sys.modules[type(attn).__module__]
        self._rotate = family.apply_rotary_pos_emb
        self._attend = family.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                     family.eager_attention_forward)

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, **kwargs):
        cache = kwargs.pop("cache", None)  # transformers' name for it, by version
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        kwargs.pop("use_cache", None)
        kwargs.pop("position_ids", None)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (t.view(shape) for t in self.qkv_proj(hidden_states).split(self.sizes, dim=-1))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = position_embeddings
        q, k = self._rotate(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out, weights = self._attend(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                                    sliding_window=getattr(self, "sliding_window", None), **kwargs)
        out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.o_proj(out), weights


class FusedMLP(nn.Module):
    """The gated MLP with gate and up as one GEMM."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.width = mlp.gate_proj.out_features
        self.gate_up_proj = _stacked([mlp.gate_proj, mlp.up_proj])
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.width, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def fuse(layer: nn.Module) -> bool:
    """Merge ``layer``'s projections in place (see the module's contract); whether it did."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if isinstance(attn, FusedAttention) or attn is None or mlp is None:
        return False
    projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    gated = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
    family = sys.modules[type(attn).__module__]
    if (None in projections + gated or not _plain(*projections) or not _plain(*gated)
            or not all(hasattr(family, n) for n in ("apply_rotary_pos_emb", "ALL_ATTENTION_FUNCTIONS",
                                                       "eager_attention_forward"))
            or not hasattr(mlp, "act_fn")):
        return False
    layer.self_attn = FusedAttention(attn)
    layer.mlp = FusedMLP(mlp)
    return True
