"""What a slice, the draft and their CUDA graphs hold on each device, estimated from the config.

Contract
--------
Every figure is in bytes and computed from the config alone, before anything is loaded.

``slice_needs(config, lo, hi, embed=..., head=..., dtype=..., quant=..., max_len=..., devices=...,
verifies=..., graphs=..., one_shape=...)`` is, per segment of ``ModelSlice`` (the same ``decoder.segment_runs``
of the layers over ``devices``), what that segment holds on its device (``Need``): the weights of its
layers (dense in ``dtype``, or NF4 or int8 for the decoder layers' linear weights; the embedding in the
first segment, norm + lm_head in the last), its KV cache of ``max_len`` slots (a tree's scratch
slots included by the caller), an eager workspace, and one ``Graph`` per CUDA graph it captures:
for each verify shape ``(positions, tree)`` (``handshake.Hello.shapes()``), one per attention
window holding it (``kv.windows_for``; a one-shape slice's every window, whatever its shape, and
its K/V of ``kv.StaticKV.total`` slots), each with ``positions`` rows of logits in a slice with
the head. ``draft_graphs(...)`` are the draft's graphs, as ``Drafter.capture`` takes them: its
expansion step, greedy and sampled, per window.

The workspace: one layer's forward of a 512-token prefill chunk (a one-shape slice's: a piece of its
row count) over all slots (hidden states,
q/k/v, the MLP, the additive mask, the keys/values repeated per head, attention scores in fp32
should SDPA fall back to its math kernel, with NF4 one linear weight dequantised, with int8 the
input's int8 rows and the int32 product of the widest linear), or, if
larger, what loading holds besides the weights (``loading_bytes``: a tensor as the checkpoint
stores it, bf16 by its config, beside its copy in the slice dtype while it converts, up to an
embedding or lm_head; quantised, one dense layer until it is quantised; loading comes before any
forward, and the allocator reuses its blocks); plus the rows of logits of the largest verify with
their softmax and sampling copies. Quantised segments also count ``fragments``: the holes between the
quantised weights, which land in blocks their dense layers left (1/``NF4_FRAGMENTS`` of the
quantised layers' bytes). ``device_bytes`` adds up what one device holds: workspaces are needed
once per device (forwards run one at a time), ``FIXED_SLACK`` once (what CUDA loads after the
check, outside torch's allocator, and cuBLAS's workspaces), 5 % of the weights for rounding.
``bench/bigmodel_bench.py`` measures the same layouts (random weights in the public shapes) phase
by phase. Calibrated on the peaks it measured on one H100 for 32B and 72B NF4 halves in fp16 (one
segment, 3000-3500-token contexts: torch's peak reserved bytes, 2.7-7.7 % above the estimate
before ``loading_bytes``' copy and ``fragments`` were counted; 1.9-11.6 % below it now,
``tests/model/test_memory_parts.py``); what CUDA loads outside torch's allocator was not measured
there, and the 7B dense, bf16 and two-segment layouts were not measured against this estimate.

Graphs (``graphs.py``): all graphs of a device share one memory pool, so a device's graphs hold
``pool_bytes``: ``POOL_BASE`` once (the capture stream's cuBLAS workspace and the pool's first
segments), the largest graph's temporaries once (each is dead once its graph has run), and every
graph's outputs plus ``GRAPH_BYTES`` for its executable, inputs and rounding. Parameter counts
are exact: one decoder layer is built on the meta device and counted. Loads nothing; knows
nothing about free memory (``memory.py`` compares these needs with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sfchat.model.kv import BLOCK, PREFILL_CHUNK, SPAN, cache_slots, windows_for
from sfchat.model.decoder import layer_bytes, layer_counts, segment_runs

MIB, GIB = 1 << 20, 1 << 30
# per device: what CUDA takes after the check besides torch's tensors (the modules of torch, cuBLAS and
# bitsandbytes loaded on their first use), the cuBLAS workspaces of eager forwards, allocator rounding
FIXED_SLACK = 512 * MIB
NF4_FRAGMENTS = 8  # NF4 loading leaves 1/8 of the quantised layers' bytes as holes between them (see above)
POOL_BASE = 64 * MIB  # per device with graphs: the capture stream's cuBLAS workspace (32 MiB on Hopper), first segments
GRAPH_BYTES = 2 * MIB  # per graph: its executable's device memory, its input buffers, rounding of its outputs


@dataclass(frozen=True)
class Graph:
    temporaries: int  # alive only while the graph runs: the device's pool reuses them for every graph
    outputs: int  # held in the pool for as long as the graph lives


def pool_bytes(graphs) -> int:
    """What a device's graphs hold in its shared pool."""
    graphs = list(graphs)
    if not graphs:
        return 0
    return POOL_BASE + max(g.temporaries for g in graphs) + sum(g.outputs + GRAPH_BYTES for g in graphs)


@dataclass(frozen=True)
class Need:
    """What one slice segment (or the draft) holds on its device: ``work`` is the temporaries of
    its largest eager forward (or of loading), reused by every other forward on that device."""

    weights: int
    kv: int
    work: int
    graphs: tuple[Graph, ...] = ()
    fragments: int = 0  # reserved by the allocator between its tensors, beyond the 5 % of its weights

    @property
    def total(self) -> int:
        return device_bytes([self])

    def describe(self) -> str:
        graphs = f", {len(self.graphs)} CUDA graphs {gib(pool_bytes(self.graphs))}" if self.graphs else ""
        return (f"{gib(self.total)} (weights {gib(self.weights)}, KV cache {gib(self.kv)}, "
                f"workspace {gib(self.work + FIXED_SLACK + self.weights // 20 + self.fragments)}{graphs})")


def device_bytes(needs) -> int:
    """What ``needs`` on one device hold together: their weights (+ 5 % for rounding and
    fragments, and NF4 loading's holes) and KV caches, the largest workspace once (forwards run one at a time, and the
    allocator hands one's freed blocks to the next), ``FIXED_SLACK`` once, and the graph pool."""
    needs = list(needs)
    if not needs:
        return 0
    return (sum(n.weights + n.weights // 20 + n.fragments + n.kv for n in needs) + max(n.work for n in needs)
            + FIXED_SLACK + pool_bytes(g for n in needs for g in n.graphs))


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_position(config, n_layers: int, dtype: torch.dtype) -> int:
    return 2 * n_layers * config.num_key_value_heads * head_dim(config) * dtype.itemsize


def forward_bytes(config, tokens: int, window: int, dtype: torch.dtype, quant: str, rows: int = 0,
                  canonical: bool = False) -> int:
    """The temporaries of a forward of ``tokens`` over ``window`` slots (one layer's worth: each
    layer's are freed before the next runs) with ``rows`` rows of logits; ``canonical`` (a one-shape
    slice's attention, ``model.attention``) adds its context mask, a row per query head, its blocks'
    queries and outputs, and its own part: each row's ``SPAN`` keys and values gathered (in float32,
    as a CPU does), their scores, the merged output."""
    b = dtype.itemsize
    H, inter, V = config.hidden_size, config.intermediate_size, config.vocab_size
    heads, kv_heads, hd = config.num_attention_heads, config.num_key_value_heads, head_dim(config)
    layer = tokens * (6 * H + 3 * heads * hd + 4 * kv_heads * hd + 4 * inter) * b + tokens * H * 4 * 2
    attn = tokens * window * 12 * heads  # fp32 scores, masked, softmax: SDPA's math kernel
    if tokens > 1 and heads != kv_heads:  # transformers repeats K/V per head under a mask (one query packs)
        attn += 2 * heads * window * hd * b
    mask = tokens * window * (b + 2) + window * 16 + tokens * hd * 16  # and the rotary tables
    dequant = layer_counts(config)[2] * b if quant == "nf4" and tokens > 1 else 0  # bnb's dequantised weight
    if quant == "int8":  # the input's int8 rows (from an fp16 copy), the int32 product, its rescaled copy
        widest = max(H, inter, heads * hd)
        dequant = tokens * widest * (2 + 1 + 4 + b) + tokens * 8
    logits = rows * (H * 4 + V * (b + 4))
    if canonical:  # and per block of the context part: the queries' copy, its output in float32, twice
        attn += (heads // kv_heads) * tokens * -(-window // BLOCK) * BLOCK * b + tokens * SPAN * (8 * kv_heads * hd + 12 * heads) \
            + tokens * heads * hd * 4 * 4 + -(-window // BLOCK) * tokens * heads * (hd * (b + 8) + 8)
    return layer + attn + mask + dequant + logits


def checkpoint_dtype(config) -> torch.dtype:
    """The dtype the checkpoint stores its weights in (its config's; bf16, what most hold, when it
    names none)."""
    named = getattr(config, "dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) else torch.bfloat16


def loading_bytes(config, n_layers: int, dtype: torch.dtype, quant: str, ends: bool) -> int:
    """The temporaries of loading a segment of ``n_layers`` (with the embedding or lm_head when
    ``ends``): a tensor as read, in the checkpoint's dtype, beside its copy in ``dtype`` when the
    two differ (the largest: an end's ``vocab x hidden``, else a layer's largest linear); with NF4,
    a layer's dense linears in ``dtype`` until the layer is complete and quantised, with its largest
    linear's fp32 block scales while it quantises."""
    _, _, largest = layer_counts(config)
    copy = checkpoint_dtype(config).itemsize if checkpoint_dtype(config) != dtype else 0
    layers = largest * copy if n_layers else 0
    if quant == "nf4" and n_layers:
        layers += layer_counts(config)[0] * dtype.itemsize + largest * 4 // 64
    if quant == "int8" and n_layers:  # the dense layer, and its largest linear's fp16 copy and int8 rows
        layers += layer_counts(config)[0] * dtype.itemsize + largest * 3
    return max(layers, config.vocab_size * config.hidden_size * copy if ends else 0)


def slice_needs(config, lo: int, hi: int, *, embed: bool, head: bool, dtype: torch.dtype, quant: str,
                max_len: int, devices: list[torch.device], verifies=(), graphs: bool = True, reserved=(),
                span: int = 0, one_shape: bool = False) -> list[tuple[torch.device, Need]]:
    """Per segment: its device and what it holds there (see the module docstring); ``span``: the
    slots a tree forward's queries see when more than its positions (the head's: its scratch pool,
    ``ModelSlice.capture(span=)``), which leaves out the windows too small for them."""
    b = dtype.itemsize
    H, V = config.hidden_size, config.vocab_size
    tied = getattr(config, "tie_word_embeddings", False)
    runs = segment_runs(config, lo, hi, embed=embed, head=head, dtype=dtype, quant=quant, segments=len(devices),
                        reserved=reserved)
    windows = windows_for(max_len)
    rows = max((p for p, _ in verifies), default=1) if head else 0
    out = []
    for i, ((start, stop), device) in enumerate(zip(runs, devices)):
        n = stop - start
        first, last = i == 0, i == len(runs) - 1
        shared = tied and embed and device == devices[0]  # a tied lm_head on the embedding's device shares it
        ends = V * H * ((1 if embed and first else 0) + (1 if head and last and not shared else 0))
        weights = n * layer_bytes(config, dtype, quant) + ends * b + (H * b if head and last else 0)
        kv = kv_bytes_per_position(config, n, dtype) * cache_slots(max_len, one_shape)
        chunk = min(max((p for p, _ in verifies), default=1) if one_shape else PREFILL_CHUNK, max_len)  # a prefill's piece
        loading = loading_bytes(config, n, dtype, quant, ends=bool(ends))
        forward = forward_bytes(config, chunk, max_len, dtype, quant, canonical=one_shape) if n else 0
        logits = rows * V * (4 * 3 + b) if head and last else 0  # float logits, softmax and sampling copies
        work = max(loading, forward) + logits
        seg_rows = rows if head and last else 0
        seg_graphs = tuple(
            Graph(forward_bytes(config, p, w, dtype, quant, p if seg_rows else 0, canonical=one_shape),
                  p * V * 4 if seg_rows else p * H * b)
            for p, _ in verifies for w in windows if one_shape or w >= max(p, span)
        ) if graphs and device.type == "cuda" else ()
        holes = n * layer_bytes(config, dtype, quant) // NF4_FRAGMENTS if quant != "none" else 0
        out.append((device, Need(weights, kv, int(work), seg_graphs, holes)))
    return out


def slice_need(config, lo: int, hi: int, *, embed: bool, head: bool, dtype: torch.dtype, quant: str,
               max_len: int, verifies=(), device: torch.device = torch.device("cuda")) -> Need:
    """The need of the slice in one segment on ``device``."""
    return slice_needs(config, lo, hi, embed=embed, head=head, dtype=dtype, quant=quant, max_len=max_len,
                       devices=[device], verifies=verifies)[0][1]


def draft_graphs(config, dtype: torch.dtype, quant: str, max_len: int, *, rows: int, children: int, pool: int
                 ) -> tuple[Graph, ...]:
    """The graphs ``Drafter.capture`` takes: its expansion step of ``rows`` nodes, keeping
    ``children`` continuations of each, greedy and sampled, per window that holds its ``pool``
    scratch slots (compiled or not)."""
    V = config.vocab_size
    windows = [w for w in windows_for(max_len) if w >= pool + 1]
    sampling = V * 48  # warped probabilities, their top-k and sort copies, for one row
    temporaries = {w: forward_bytes(config, rows, w, dtype, quant, rows) + rows * (V * 4 * 3 + sampling)
                   for w in windows}
    return tuple(Graph(temporaries[w], rows * children * 16) for w in windows for _ in ("greedy", "sampled"))
