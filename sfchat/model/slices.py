"""A contiguous slice of a decoder-only transformer, loaded without materialising the rest.

Contract
--------
``ModelSlice.load(source, lo, hi, embed=..., head=...)`` builds transformers' own decoder
layers ``[lo, hi)`` (Qwen2 / Qwen2.5, Qwen3, Llama families) on the meta device, reads only
their tensors (plus the embedding when ``embed``, the final norm and lm_head when ``head``)
from the checkpoint's shard files, and owns a ``StaticKV`` for exactly those layers. Tied
checkpoints have no ``lm_head.weight``: the embedding matrix is used for it.

``forward(x, positions, n_logits, window)``: ``x`` is token ids ``(n,)`` when the slice has the
embedding, else hidden states ``(n, H)``; ``positions`` the absolute positions ``(n,)``;
``window`` the KV slots attended over (all by default); ``tree`` (a ``kv.TreeMask``) makes it a
tree forward: ``positions`` are then the slots written and the mask and rotary positions come
from the tree. It returns hidden states ``(n, H)``,
or — for a slice with the head — logits ``(n_logits, V)`` of the last ``n_logits`` positions.
``run(x, positions, n_logits, end=...)`` is the same forward over the smallest window holding
``end`` (the host-side end of ``positions``), replayed from a CUDA graph when one was captured
for that shape (``capture`` captures one per window, with the tree's tensors as graph inputs for
a tree forward). ``keep(src, start, tokens)`` moves the K/V of an accepted tree path to the
slots from ``start`` on, in every KV cache of the slice, and records them. The draft model is simply the slice
``[0, L)`` with both ends. The slice does not know which tokens are drafts, nor anything about
the wire.

``quant="nf4"`` loads the decoder layers' linear weights as 4-bit NF4 (``quant.py``), one layer
at a time. ``devices`` (two GPUs of one node) spreads the layers evenly over them: each layer
and its KV cache live on one device, the hidden states move at the boundary, the embedding sits
on the first device and norm + lm_head on the last; inputs and outputs stay on the first device
(``self.device``). Such a slice runs eagerly: a CUDA graph belongs to one device.
"""

from __future__ import annotations

import importlib
import inspect

import torch
from torch import nn

from sfchat import UserError
from sfchat.model.graphs import GraphTable
from sfchat.model.kv import StaticKV, TreeMask
from sfchat.model.quant import check_mode, quantize_linears
from sfchat.model.source import ModelSource, Progress, _no_progress

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


def spread(n: int, devices: list[torch.device]) -> list[torch.device]:
    """The device of each of ``n`` consecutive layers: contiguous, as even as possible."""
    return [devices[i * len(devices) // n] for i in range(n)] if n else []


class ModelSlice(nn.Module):
    def __init__(self, config, lo: int, hi: int, *, embed: bool, head: bool,
                 dtype: torch.dtype, device: torch.device, max_len: int,
                 devices: list[torch.device] | None = None):
        super().__init__()
        layer_cls, norm_cls, rotary_cls = architecture(config)
        types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in types[lo:hi]):
            raise UserError("models with sliding-window attention layers are not supported")
        config._attn_implementation = "sdpa"
        self.config, self.lo, self.hi = config, lo, hi
        self.dtype, self.device = dtype, device
        self.layer_devices = spread(hi - lo, list(devices or [device]))
        self.last_device = self.layer_devices[-1] if self.layer_devices else device
        with torch.device("meta"):
            self.layers = nn.ModuleList(layer_cls(config, i) for i in range(lo, hi))
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if embed else None
            self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps) if head else None
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if head else None
        # inv_freq is a non-persistent buffer: build the rotary embedding on the real device
        self.rotary = rotary_cls(config=config).to(device)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # one KV cache per device, indexed by the layer's slot on that device; ``self.kv`` (the
        # first) also keeps the slice's bookkeeping of which tokens its slots hold
        self.groups: list[tuple[torch.device, StaticKV, list[nn.Module]]] = []
        for dev in dict.fromkeys(self.layer_devices or [device]):
            layers = [layer for layer, d in zip(self.layers, self.layer_devices) if d == dev]
            for local, layer in enumerate(layers):
                layer.self_attn.layer_idx = local
            self.groups.append((dev, StaticKV(len(layers), config.num_key_value_heads, head_dim, max_len,
                                              dtype, dev), layers))
        self.kv = self.groups[0][1]
        params = inspect.signature(layer_cls.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.graphs = GraphTable()  # keys: (tokens, logits, tree)

    # -- loading -------------------------------------------------------------------------------
    def tensor_names(self) -> dict[str, tuple[nn.Module, str]]:
        """Checkpoint tensor name -> (module, attribute path) for everything this slice needs."""
        names = {}
        for local, layer in enumerate(self.layers):
            for pname in layer.state_dict().keys():
                names[f"model.layers.{self.lo + local}.{pname}"] = (layer, pname)
        if self.embed_tokens is not None:
            names["model.embed_tokens.weight"] = (self.embed_tokens, "weight")
        if self.norm is not None:
            names["model.norm.weight"] = (self.norm, "weight")
        return names

    def device_of(self, module: nn.Module) -> torch.device:
        for layer, dev in zip(self.layers, self.layer_devices):
            if module is layer:
                return dev
        return self.last_device if module is self.norm or module is self.lm_head else self.device

    @classmethod
    def load(cls, source: ModelSource, lo: int, hi: int, *, embed: bool, head: bool,
             dtype: torch.dtype, device: torch.device, max_len: int,
             progress: Progress = _no_progress, quant: str = "none",
             devices: list[torch.device] | None = None) -> "ModelSlice":
        check_mode(quant)
        sl = cls(source.config, lo, hi, embed=embed, head=head, dtype=dtype, device=device, max_len=max_len,
                 devices=devices)
        wanted = sl.tensor_names()
        head_name = None
        if head:
            tied = getattr(source.config, "tie_word_embeddings", False) or "lm_head.weight" not in source.weight_map
            head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        names = list(wanted) + ([head_name] if head_name and head_name not in wanted else [])
        state: dict[nn.Module, dict[str, torch.Tensor]] = {}
        expected: dict[nn.Module, int] = {}
        for module, _ in wanted.values():
            expected[module] = expected.get(module, 0) + 1
        layers = set(sl.layers)
        single = len(sl.groups) == 1
        dev = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
        for name, tensor in source.read(names, dev if single else "cpu", progress):
            if name in wanted:
                module, attr = wanted[name]
                tensor = tensor.to(sl.device_of(module)).to(dtype)
                state.setdefault(module, {})[attr] = tensor
                if len(state[module]) == expected[module]:  # complete: load it (and quantise a layer) now
                    module.load_state_dict(state.pop(module), strict=True, assign=True)
                    if quant == "nf4" and module in layers:
                        quantize_linears(module, dtype)
            if name == head_name:  # a tied head shares the embedding's tensor when on the same device
                sl.lm_head.weight = nn.Parameter(tensor.to(sl.last_device).to(dtype), requires_grad=False)
        for module, sd in state.items():  # incomplete modules: strict loading names what is missing
            module.load_state_dict(sd, strict=True, assign=True)
        for p in sl.parameters():
            p.requires_grad_(False)
        left = [n for n, p in sl.named_parameters() if p.is_meta]
        if left:
            raise UserError(f"checkpoint {source.name!r} did not provide {left[0]}")
        return sl.eval()

    # -- compute -------------------------------------------------------------------------------
    def capture(self, n_tokens: int, n_logits: int = 0, log=None, tree: bool = False) -> bool:
        """Capture the ``n_tokens`` forward (a tree forward with ``tree``) as CUDA graphs, one
        per attention window that can hold it (before any conversation); False when none could
        be captured."""
        if len(self.groups) > 1:
            if log is not None:
                log(f"layers [{self.lo}, {self.hi}) span {len(self.groups)} GPUs: their forward runs eagerly "
                    "(a CUDA graph belongs to one device)")
            return False
        if self.embed_tokens is not None:
            x = torch.zeros(n_tokens, dtype=torch.long, device=self.device)
        else:
            x = torch.zeros(n_tokens, self.config.hidden_size, dtype=self.dtype, device=self.device)
        positions = torch.arange(n_tokens, device=self.device)
        key = self._key(n_tokens, n_logits, tree)
        inputs = (x, positions)
        if tree:  # a chain as example: rope = slots, base 0, each token sees its predecessors
            inputs += (positions.clone(), positions[:1].clone(),
                       torch.ones(n_tokens, n_tokens, dtype=torch.bool, device=self.device).tril())
        what = f"{n_tokens}-token {'tree ' if tree else ''}forward of layers [{self.lo}, {self.hi})"
        return self.graphs.capture(key, what, self._plain(n_logits, tree), inputs,
                                   [w for w in self.kv.windows if w >= n_tokens], log)

    def _key(self, n_tokens: int, n_logits: int, tree: bool) -> tuple[int, int, bool]:
        return n_tokens, n_logits if self.lm_head is not None else 0, tree

    def _plain(self, n_logits: int, tree: bool):
        """``forward`` as a function of tensors and the window: what ``capture`` captures and
        ``run`` calls where nothing was captured."""
        def fn(x, positions, *args):  # (x, positions, [rope, base, visible,] window)
            *tensors, window = args
            return self.forward(x, positions, n_logits, window, TreeMask(*tensors) if tree else None)
        return fn

    def captured(self, n_tokens: int, n_logits: int = 0, tree: bool = False) -> bool:
        """Whether that forward replays from a graph."""
        return self._key(n_tokens, n_logits, tree) in self.graphs

    def run(self, x: torch.Tensor, positions: torch.Tensor, n_logits: int = 0, *, end: int | None = None,
            tree: TreeMask | None = None) -> torch.Tensor:
        """``forward`` over the smallest window holding positions below ``end`` (all slots when
        None), replayed from a captured graph when one fits the shape."""
        window = self.kv.window_for(end) if end is not None else self.kv.max_len
        inputs = (x, positions, *(tree.tensors() if tree is not None else ()))
        return self.graphs.run(self._key(x.shape[0], n_logits, tree is not None), self._plain(n_logits, tree is not None),
                               inputs, window)

    def keep(self, src: list[int], start: int, tokens: list[int]) -> None:
        """After a tree verdict: the K/V of the accepted nodes, written at slots ``src``, move to
        ``start, start + 1, ...`` (in every KV cache of the slice); ``tokens`` are recorded there."""
        dst = list(range(start, start + len(src)))
        for _, kv, _ in self.groups:
            kv.move(src, dst)
        self.kv.note(start, tokens)

    def save(self, start: int, n: int) -> list:
        """A copy of slots ``start .. start + n - 1`` in every KV cache of the slice (``restore``)."""
        return [kv.save(start, n) for _, kv, _ in self.groups]

    def restore(self, saved: list) -> None:
        for (_, kv, _), part in zip(self.groups, saved):
            kv.load(part)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, positions: torch.Tensor, n_logits: int = 0,
                window: int | None = None, tree: TreeMask | None = None) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x.to(self.dtype)
        h = h[None]
        pos = (tree.rope if tree is not None else positions)[None]
        slots = positions
        rope = self.rotary(h, pos)
        for dev, kv, layers in self.groups:
            if len(self.groups) > 1 and h.device != dev:  # the next layers live on the node's other GPU
                h, pos, rope = h.to(dev), pos.to(dev), tuple(r.to(dev) for r in rope)
                slots = slots.to(dev)
                if tree is not None:
                    tree = TreeMask(*(t.to(dev) for t in tree.tensors()))
            mask = kv.begin(slots, window, tree)
            kw = {self._cache_kw: kv}
            for layer in layers:
                h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope, **kw)
                if isinstance(h, tuple):  # older transformers return (hidden,)
                    h = h[0]
        if self.lm_head is None:
            return h[0].to(self.device)
        h = self.norm(h[0, -n_logits:])
        return self.lm_head(h).float().to(self.device)
