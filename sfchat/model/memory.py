"""Will it fit? Each node's GPU memory need, estimated from the config before anything is loaded.

Contract
--------
``slice_need(config, lo, hi, embed=..., head=..., dtype=..., quant=..., max_len=..., k=...)``
estimates, in bytes, what ``ModelSlice.load`` of layers ``[lo, hi)`` will hold: the weights
(dense in ``dtype``, or NF4 for the decoder layers' linear weights), the static KV cache of
``max_len`` positions, and a workspace for the forwards (a 512-token prefill chunk, the K+1
verify or the token tree, whose rows of logits grow with the budget (``k`` is then the budget),
allocator slack, and the memory pools of the CUDA graphs: one per attention window of the KV
cache, ``GRAPH_POOL_BYTES`` each, from 232 MiB measured for the six windows of a Qwen2.5-7B
half's 9-token verify on an H200, bf16, 8201 slots). Parameter counts are exact: one decoder
layer is built on the meta device and counted (biases and q/k norms included). The workspace is
a deliberately generous estimate, checked against torch's peak allocation on an H200
(``bench/nf4_memory_bench.py``, fp16, 4105 slots: 4-5 % above the peak for a Qwen2.5-7B half,
15 % with NF4, 33-56 % for the 0.5B draft; the bf16 peaks were lower still).

``check_fits(plan, hints)`` adds up the needs per CUDA device (``plan``: ``(what, devices,
Need)``, a need spread evenly over ``devices``), compares each sum with what is free there
(``torch.cuda.mem_get_info`` plus what torch's allocator holds unused) and raises a
``UserError`` naming the device, the figures and ``hints`` (the fixes that apply to the caller:
4-bit, a shorter context, another split, another device). CPU devices are not checked.
``SFCHAT_NO_MEMORY_CHECK=1`` skips the check (the estimate may be wrong for a new GPU or driver).
This module loads nothing and knows nothing about the wire.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from sfchat import UserError
from sfchat.model.kv import PREFILL_CHUNK, windows_for
from sfchat.model.quant import NF4_BYTES_PER_WEIGHT
from sfchat.model.slices import architecture

FIXED_SLACK = 256 << 20  # cuBLAS workspaces, allocator rounding
GRAPH_POOL_BYTES = 40 << 20  # one captured forward's private memory pool (allocator segments)
GIB = 1 << 30


@dataclass(frozen=True)
class Need:
    weights: int
    kv: int
    work: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.work

    def describe(self) -> str:
        return f"{gib(self.total)} (weights {gib(self.weights)}, KV cache {gib(self.kv)}, workspace {gib(self.work)})"


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


_layer_counts: dict[tuple, tuple[int, int]] = {}


def layer_counts(config) -> tuple[int, int]:
    """(weights of the linear layers, all other parameters) of one decoder layer."""
    key = (config.model_type, config.hidden_size, config.intermediate_size, config.num_attention_heads,
           config.num_key_value_heads, getattr(config, "head_dim", None), getattr(config, "attention_bias", None))
    if key not in _layer_counts:
        layer_cls, _, _ = architecture(config)
        with torch.device("meta"):
            layer = layer_cls(config, 0)
        linear = sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
        _layer_counts[key] = (linear, sum(p.numel() for p in layer.parameters()) - linear)
    return _layer_counts[key]


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_position(config, n_layers: int, dtype: torch.dtype) -> int:
    return 2 * n_layers * config.num_key_value_heads * head_dim(config) * dtype.itemsize


def slice_need(config, lo: int, hi: int, *, embed: bool, head: bool, dtype: torch.dtype, quant: str,
               max_len: int, k: int) -> Need:
    b = dtype.itemsize
    n = hi - lo
    H, V, inter = config.hidden_size, config.vocab_size, config.intermediate_size
    linear, other = layer_counts(config)
    per_linear = NF4_BYTES_PER_WEIGHT if quant == "nf4" else b
    tied = getattr(config, "tie_word_embeddings", False)
    ends = V * H * ((1 if embed else 0) + (1 if head and not (tied and embed) else 0)) + (H if head else 0)
    weights = int(n * (linear * per_linear + other * b) + ends * b)
    kv = kv_bytes_per_position(config, n, dtype) * max_len
    # one layer's forward of a prefill chunk: hidden states, q/k/v, the MLP, the additive mask, the
    # keys/values repeated per head, and the attention scores in fp32 (scores, masked, softmax)
    # should SDPA fall back to its math kernel, as it did in fp16 on an H200 (bench/RESULTS.md)
    heads, kv_heads, hd = config.num_attention_heads, config.num_key_value_heads, head_dim(config)
    chunk = min(PREFILL_CHUNK, max_len)
    act = chunk * (4 * H + (heads + 2 * kv_heads) * hd + 3 * inter) * b
    attn = chunk * max_len * (b + 3 * 4 * heads) + 2 * heads * max_len * hd * b if n else 0
    logits = (k + 1) * V * (4 * 3 + b) if head else 0  # float logits, softmax and sampling copies
    loading = linear * b if quant == "nf4" and n else 0  # one layer dense before it is quantised
    # a whole model (the draft) captures its round and its one-token guess step per window
    graphs = GRAPH_POOL_BYTES * len(windows_for(max_len)) * (2 if embed and head else 1)
    work = act + attn + logits + loading + graphs + FIXED_SLACK + weights // 20  # + 5%: rounding, fragments
    return Need(weights, kv, int(work))


def _cuda_key(device: torch.device) -> torch.device:
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def free_bytes(device: torch.device) -> int:
    """What a new allocation on ``device`` can get: free memory plus what torch holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_fits(plan: list[tuple[str, list[torch.device], Need]], hints: list[str]) -> None:
    """Raise a UserError when the needs of ``plan`` exceed the free memory of a CUDA device."""
    if os.environ.get("SFCHAT_NO_MEMORY_CHECK", "") not in ("", "0"):
        return
    per_device: dict[torch.device, list[tuple[str, Need]]] = {}
    for what, devices, need in plan:
        cuda = [d for d in devices if d.type == "cuda"]
        for d in cuda:
            share = Need(need.weights // len(cuda), need.kv // len(cuda), need.work)
            per_device.setdefault(_cuda_key(d), []).append((what if len(cuda) == 1 else f"{what} (share)", share))
    for device, items in per_device.items():
        total = sum(need.total for _, need in items)
        free = free_bytes(device)
        if total <= free:
            continue
        parts = "; ".join(f"{what} {need.describe()}" for what, need in items)
        fixes = f" Try {', or '.join(hints)}." if hints else ""
        raise UserError(f"not enough GPU memory on {device}: loading needs about {gib(total)} ({parts}) but only "
                        f"{gib(free)} is free.{fixes} (The figure is an estimate: SFCHAT_NO_MEMORY_CHECK=1 "
                        "skips this check.)")


def hints(role: str, *, quant: str, max_len: int, kv_per_position: int, gpus: int, spread: bool,
          draft: str | None = None, tree_budget: int = 0) -> list[str]:
    """The fixes that apply to ``role`` ("head", "tail" or "local"), most effective first."""
    out = []
    if tree_budget:
        out.append(f"a smaller --tree-budget{' on the head' if role == 'tail' else ''} (now {tree_budget}: "
                   "each node adds a row of logits and a KV slot)")
    if quant != "nf4":
        out.append("--load-in-4bit (NF4: the layers take about a quarter of their 16-bit size)" if role != "tail"
                   else "--load-in-4bit on the head (the tail follows it)")
    out.append(f"a shorter --max-context{' on the head' if role == 'tail' else ''} (now {max_len} positions, "
               f"{kv_per_position * 1024 / GIB:.2f} GiB of KV cache per 1024 positions)")
    if role == "head":
        out.append("a smaller --split (moves layers to the tail)")
    elif role == "tail":
        out.append("a larger --split on the head (moves layers to the head)")
    if gpus >= 2 and not spread:
        out.append("--device cuda:0,cuda:1 (spreads the layers over both GPUs)" if role != "tail"
                   else "--device cuda:0,cuda:1 on the tail (spreads its layers over both GPUs)")
    if draft:
        out.append(draft)
    return out


def check_head(config, split: int, *, devices: list[torch.device], dtype: torch.dtype, quant: str, max_len: int,
               k: int, draft=None, local: bool = False, tree_budget: int = 0) -> None:
    """The head's check: its slice, the draft (``(config, device, dtype, quant)``) and, in local
    mode, the tail's slice in the same process on the same devices; ``max_len`` counts the
    tree's scratch slots."""
    L = int(config.num_hidden_layers)
    k = max(k, tree_budget)
    plan = [("head layers", devices, slice_need(config, 0, split, embed=True, head=False, dtype=dtype, quant=quant,
                                                max_len=max_len, k=k))]
    if local:
        plan.append(("tail layers", devices, slice_need(config, split, L, embed=False, head=True, dtype=dtype,
                                                        quant=quant, max_len=max_len, k=k)))
    draft_hint = None
    if draft is not None:
        dconfig, ddevice, ddtype, dquant = draft
        dn = int(dconfig.num_hidden_layers)
        plan.append(("draft", [ddevice], slice_need(dconfig, 0, dn, embed=True, head=True, dtype=ddtype,
                                                    quant=dquant, max_len=max_len, k=0)))
        fixes = [] if dquant == "nf4" else ["--draft-load-in-4bit"]
        if ddevice in devices and _gpus() >= 2:
            fixes.append("--draft-device on the other GPU")
        draft_hint = ", ".join(fixes + ["--draft none"]) + " (the draft)"
    check_fits(plan, hints("local" if local else "head", quant=quant, max_len=max_len,
                           kv_per_position=kv_bytes_per_position(config, L if local else split, dtype),
                           gpus=_gpus(), spread=len(devices) > 1, draft=draft_hint, tree_budget=tree_budget))


def check_tail(config, split: int, *, devices: list[torch.device], dtype: torch.dtype, quant: str,
               max_len: int, k: int, tree_budget: int = 0) -> None:
    L = int(config.num_hidden_layers)
    k = max(k, tree_budget)
    need = slice_need(config, split, L, embed=False, head=True, dtype=dtype, quant=quant, max_len=max_len, k=k)
    per_position = kv_bytes_per_position(config, L - split, dtype)
    check_fits([("tail layers", devices, need)],
               hints("tail", quant=quant, max_len=max_len, kv_per_position=per_position, gpus=_gpus(),
                     spread=len(devices) > 1, tree_budget=tree_budget))


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
