"""The slices' attention, registered with transformers' attention interface as ``"sfchat"``.

Contract
--------
A slice's decoder layers are transformers' own; their attention modules call ``attention``
with the mask their cache's ``begin`` returned (``kv.StaticKV``):

* an additive mask tensor (the draft, and every slice without one row count): transformers' own
  SDPA attention, unchanged;
* a ``kv.Attend`` (a one-shape slice's, ``ModelSlice(rows=)``): canonical attention, in two parts
  merged by their log-sum-exp in float32. (1) The context part: every row against all of the
  cache's slots in one fused kernel call of one shape (the query heads of a key head stacked as
  rows, so keys are never repeated), masked to the slots below the row's own positions; (2) the
  row's own part: its last ``SPAN`` positions, gathered in position order from wherever they sit,
  in float32. A row's arithmetic then depends only on its query, on the context's keys at their
  positions and on its own keys in order: not on the other rows, on the slots its ancestors hold,
  or on how far the context was committed when it ran.

Part (1) runs on a GPU through PyTorch's memory-efficient attention kernel (which returns the
log-sum-exp), on a CPU as the same arithmetic in float32 matrix products. Knows nothing of
trees, frames or the wire.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sfchat.model.kv import Attend

NAME = "sfchat"


def context_part(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` (1, Hkv, m, D) against ``key``/``value`` (1, Hkv, T, D) under ``bias`` (m, T): the
    normalised output (1, Hkv, m, D) and the log-sum-exp (1, Hkv, m), both float32."""
    bias = bias[None, None].expand(1, key.shape[1], -1, -1)
    if q.device.type == "cuda":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, key, value, bias, True, 0.0, False, scale=scale)
        return out.float(), lse[..., :q.shape[2]].float()
    scores = torch.matmul(q.float(), key.float().transpose(-1, -2)) * scale + bias.float()
    return torch.matmul(torch.softmax(scores, -1), value.float()), torch.logsumexp(scores, -1)


def canonical(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, how: Attend, scale: float
              ) -> torch.Tensor:
    """``query`` (1, H, n, D) against the whole buffers ``key``/``value`` (1, Hkv, T, D): the
    (1, n, H, D) output in the query's dtype (query head h reads key head h // (H / Hkv))."""
    _, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    out1, lse1 = context_part(query.reshape(1, kv_heads, group * n, dim), key, value, how.bias, scale)
    out1 = out1[0].view(kv_heads, group, n, dim).transpose(1, 2)  # (Hkv, n, group, D)
    lse1 = lse1[0].view(kv_heads, group, n).transpose(1, 2)  # (Hkv, n, group)
    has = how.context[None, :, None]  # an empty part weighs nothing (the H100's kernel reports its lse as 0)
    lse1, out1 = torch.where(has, lse1, float("-inf")), torch.where(has[..., None], out1, 0.0)
    own_k, own_v = key[0][:, how.keys].float(), value[0][:, how.keys].float()  # (Hkv, n, SPAN, D)
    q = query[0].float().view(kv_heads, group, n, dim).transpose(1, 2)  # (Hkv, n, group, D)
    scores = torch.matmul(q, own_k.transpose(-1, -2)) * scale  # (Hkv, n, group, SPAN)
    scores = scores.masked_fill(~how.seen[None, :, None, :], float("-inf"))  # a row always sees itself
    lse2 = torch.logsumexp(scores, -1)
    out2 = torch.matmul(torch.softmax(scores, -1), own_v)
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top)[..., None], torch.exp(lse2 - top)[..., None]
    out = (out1 * w1 + out2 * w2) / (w1 + w2)
    return out.permute(1, 0, 2, 3).reshape(1, n, heads, dim).to(query.dtype)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              **kwargs):
    if isinstance(attention_mask, Attend):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return canonical(query, key, value, attention_mask, scale), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(NAME, attention)
