"""The decoder layers of a supported architecture: their classes, their bytes, and how a run of them
is cut into segments.

Contract
--------
``architecture(config)`` names transformers' own decoder-layer, RMS-norm and rotary-embedding
classes for a config's ``model_type`` (``ARCHITECTURES``: Qwen2 / Qwen2.5, Qwen3, Llama), or raises
a ``UserError`` naming what is supported; ``n_layers(config)`` is its decoder-layer count.
``layer_counts`` counts one decoder layer's parameters on the meta device (linear weights, the
rest, the largest linear), cached per shape; ``layer_bytes`` turns them into bytes, dense or with
NF4 or int8 linear weights. ``spread`` cuts ``n`` equal layers into contiguous runs so that the heaviest
run (its layers plus a fixed load of its own) is as light as whole layers allow;
``segment_runs`` is that spread of a slice's layers over its devices, the embedding counted in
the first run, norm + lm_head in the last, and bytes others hold on each device.

Used by ``slices.ModelSlice`` to place its segments and by ``footprint`` to estimate them, so the
estimate and the slice agree on which layers go where. Loads no weights and knows nothing of
K/V, graphs or rounds.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from sfchat import UserError
from sfchat.model.quant import bytes_per_weight

# model_type -> (module, decoder layer, rms norm, rotary embedding)
ARCHITECTURES = {
    "qwen2": ("qwen2", "Qwen2DecoderLayer", "Qwen2RMSNorm", "Qwen2RotaryEmbedding"),
    "qwen3": ("qwen3", "Qwen3DecoderLayer", "Qwen3RMSNorm", "Qwen3RotaryEmbedding"),
    "llama": ("llama", "LlamaDecoderLayer", "LlamaRMSNorm", "LlamaRotaryEmbedding"),
}


def architecture(config):
    """The transformers classes for a config, or a UserError naming what is supported."""
    mtype = getattr(config, "model_type", None)
    if mtype not in ARCHITECTURES:
        raise UserError(f"unsupported architecture {mtype!r}; sfchat supports {', '.join(ARCHITECTURES)}")
    mod_name, *names = ARCHITECTURES[mtype]
    module = importlib.import_module(f"transformers.models.{mod_name}.modeling_{mod_name}")
    return [getattr(module, n) for n in names]


def n_layers(config) -> int:
    return int(config.num_hidden_layers)


_layer_counts: dict[tuple, tuple[int, int, int]] = {}


def layer_counts(config) -> tuple[int, int, int]:
    """(weights of the linear layers, all other parameters, the largest linear's weights) of one
    decoder layer, counted on one built on the meta device."""
    key = (config.model_type, config.hidden_size, config.intermediate_size, config.num_attention_heads,
           config.num_key_value_heads, getattr(config, "head_dim", None), getattr(config, "attention_bias", None))
    if key not in _layer_counts:
        layer_cls, _, _ = architecture(config)
        with torch.device("meta"):
            layer = layer_cls(config, 0)
        sizes = [m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear)]
        _layer_counts[key] = (sum(sizes), sum(p.numel() for p in layer.parameters()) - sum(sizes), max(sizes))
    return _layer_counts[key]


def layer_bytes(config, dtype: torch.dtype, quant: str) -> int:
    """The weights of one decoder layer: dense in ``dtype``, or its linear weights in NF4 or int8."""
    linear, other, _ = layer_counts(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    min_in = min(config.hidden_size, config.intermediate_size, config.num_attention_heads * head_dim)
    return int(linear * bytes_per_weight(quant, dtype, min_in) + other * dtype.itemsize)


def spread(n: int, layer: float, loads) -> list[tuple[int, int]]:
    """The local layer ranges ``[start, stop)`` of ``n`` consecutive layers of ``layer`` bytes each,
    cut into ``len(loads)`` contiguous runs, run ``j`` also holding ``loads[j]`` bytes besides its
    layers (the embedding, norm + lm_head, a draft on that GPU): each layer goes, in turn, where the
    load stays least (ties to the earlier run), which makes the heaviest run as light as whole
    layers allow. Every run holds a layer (fewer runs when there are fewer layers); a slice of no
    layers keeps one empty run."""
    if n == 0:
        return [(0, 0)]
    loads = list(loads)[:n] or [0.0]
    counts = [1] * len(loads)
    for _ in range(n - len(loads)):
        j = min(range(len(loads)), key=lambda j: (loads[j] + (counts[j] + 1) * layer, j))
        counts[j] += 1
    bounds = [sum(counts[:j]) for j in range(len(loads) + 1)]
    return list(zip(bounds, bounds[1:]))


def segment_runs(config, lo: int, hi: int, *, embed: bool, head: bool, dtype: torch.dtype, quant: str,
                 segments: int, reserved=()) -> list[tuple[int, int]]:
    """``spread`` of the slice's layers over ``segments`` by their weights: the embedding counted
    in the first, norm + lm_head in the last, and ``reserved[j]`` bytes (others' on that device)."""
    ends = config.vocab_size * config.hidden_size * dtype.itemsize
    loads = [float(reserved[j]) if j < len(reserved) else 0.0 for j in range(max(1, segments))]
    loads[0] += ends if embed else 0
    loads[-1] += ends if head else 0
    return spread(hi - lo, layer_bytes(config, dtype, quant), loads)
