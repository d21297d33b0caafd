"""A contiguous slice of a decoder-only transformer, loaded without materialising the rest.

Contract
--------
``ModelSlice.load(source, lo, hi, embed=..., head=...)`` builds transformers' own decoder
layers ``[lo, hi)`` (Qwen2 / Qwen2.5, Qwen3, Llama families) on the meta device, reads only
their tensors (plus the embedding when ``embed``, the final norm and lm_head when ``head``)
from the checkpoint's shard files, and owns the K/V caches of exactly those layers. Tied
checkpoints have no ``lm_head.weight``: the embedding matrix is used for it.

``forward(x, positions, n_logits, window)``: ``x`` is token ids ``(n,)`` when the slice has the
embedding, else hidden states ``(n, H)``; ``positions`` the absolute positions ``(n,)``;
``window`` the KV slots attended over (all by default); ``tree`` (a ``kv.TreeMask``) makes it a
tree forward: ``positions`` are then the slots written and the mask and rotary positions come
from the tree. It returns hidden states ``(n, H)``,
or — for a slice with the head — logits ``(n_logits, V)`` of the last ``n_logits`` positions.
``run(x, positions, n_logits, end=...)`` is the same forward over the smallest window holding
``end`` (the host-side end of what the forward attends over through the window: ``positions``,
or a tree forward's ``Scratch.reach``), replayed from a CUDA graph when one was captured
for that shape (``capture`` captures one per window, with the tree's tensors as graph inputs for
a tree forward). The draft model is simply the slice ``[0, L)`` with both ends. The slice does
not know which tokens are drafts, nor anything about the wire.

The K/V has one owner: the slice. Its caches are private; ``note`` (which tokens the context
slots hold), ``reusable``, ``held``, ``move`` (K/V from slots to slots), ``reset`` and the window
queries act on every segment's cache alike, so no caller can move one segment and forget another.
Who holds which scratch slot is ``engine.scratch.Scratch``'s, which moves them through ``move``.

``rows`` makes a one-shape slice (a GPU's target slices: the reply must not depend on which
forwards computed it, and a kernel's arithmetic for a row depends on the row count, the window and
the slots its keys sit in): ``run`` refuses any forward of another row count, every forward attends
in ``kv``'s canonical form (``model.attention``; a tree forward's ``tree`` is then a
``kv.RowKeys``), and ``feed`` pads a prefill's last piece with rows that write the cache's sink
slot. ``feed(x, start)`` writes positions ``start ..`` of ``x`` as plain forwards:
pieces of ``rows`` (padded), else of up to ``chunk``. ``compiled`` (one-shape slices only, a ValueError
else): every forward ``run`` makes is its segment's function compiled whole by torch.compile with
the target's options (``attention.compile_options``), one program per shape, window and segment,
captured like the plain one (``GraphTable(compile=)``; ``--compile-frames``).

``quant="nf4"`` / ``"int8"`` loads the decoder layers' linear weights as 4-bit NF4 or int8
(``quant.py``), one layer at a time.

Segments. ``devices`` (two GPUs of one node) spreads the layers over them: each entry is one
*segment*, a contiguous run of layers (``decoder.segment_runs``: as even in bytes as whole layers allow,
the embedding counted in the first, norm + lm_head in the last, and ``reserved`` bytes per entry
that others hold on that device: the draft), with its own KV cache (``devices`` and ``ranges``
say where each segment runs and which layers it holds), the embedding in the first and norm +
lm_head in the last; inputs and outputs stay on the first device (``self.device``). A device may
appear more than once (``[cpu, cpu]``, ``[cuda:0, cuda:0]``): then one device runs several segments, which is
how the CPU tests and a one-GPU benchmark run exactly the code of a slice over two GPUs. Each
segment's forward is a plain function of tensors and the window (``_segment``): the hidden state
``(n, H)`` (token ids for the first segment of a slice with the embedding), the slots, and a
tree's tensors; ``forward`` calls them one after the other, moving the hidden state and the
inputs to the next segment's device between them, and ``run`` replays a CUDA graph per segment
(``capture`` captures one per shape, window and segment, each on its segment's device). Segments
compute exactly what one segment computes (the rotary embedding and the mask are recomputed per
segment from the same inputs), so a segmented slice's outputs equal the unsegmented slice's bit
for bit, graphed or not.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from sfchat import UserError
from sfchat.model.decoder import architecture, segment_runs
from sfchat.model.graphs import GraphTable
from sfchat.model import attention, fused
from sfchat.model.kv import PREFILL_CHUNK, RowKeys, StaticKV, TreeMask, causal_keys
from sfchat.model.quant import check_mode, quantize_linears
from sfchat.model.source import ModelSource, Progress, _no_progress

class ModelSlice(nn.Module):
    def __init__(self, config, lo: int, hi: int, *, embed: bool, head: bool,
                 dtype: torch.dtype, device: torch.device, max_len: int,
                 devices: list[torch.device] | None = None, quant: str = "none", reserved=(),
                 rows: int | None = None, compiled: bool = False):
        super().__init__()
        if compiled and not rows:
            raise ValueError("a slice's forwards compiled whole need one row count (rows): every other shape recompiles")
        layer_cls, norm_cls, rotary_cls = architecture(config)
        types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in types[lo:hi]):
            raise UserError("models with sliding-window attention layers are not supported")
        config._attn_implementation = attention.NAME  # transformers' SDPA, or the canonical form
        self.config, self.lo, self.hi = config, lo, hi
        self.dtype, self.device = dtype, device
        self.quant = quant  # how ``load`` stores the layers' linear weights
        self.rows = rows  # a one-shape slice: every forward at this row count, in the canonical form
        self.canonical = bool(rows)
        devices = list(devices or [device])
        runs = segment_runs(config, lo, hi, embed=embed, head=head, dtype=dtype, quant=quant, segments=len(devices),
                            reserved=reserved)
        self.last_device = devices[len(runs) - 1] if hi > lo else device
        with torch.device("meta"):
            self.layers = nn.ModuleList(layer_cls(config, i) for i in range(lo, hi))
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if embed else None
            self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps) if head else None
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if head else None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # one K/V cache per segment, indexed by the layer's slot in the segment: private, reached
        # only through the slice's K/V methods below, which act on every segment alike
        self._segments: list[_Segment] = []
        self.ranges: list[tuple[int, int]] = []  # each segment's layers, as global layer indices
        for (start, stop), dev in zip(runs, devices if hi > lo else [device]):
            layers = list(self.layers[start:stop])
            for local, layer in enumerate(layers):
                layer.self_attn.layer_idx = local
            self._segments.append(_Segment(dev, StaticKV(len(layers), config.num_key_value_heads, head_dim, max_len,
                                                         dtype, dev, canonical=bool(rows),
                                                         group=config.num_attention_heads
                                                         // config.num_key_value_heads), layers))
            self.ranges.append((lo + start, lo + stop))
        self.devices = [seg.device for seg in self._segments]  # one per segment, first to last
        self._written: list[int] = []  # the token id at each context slot, for every segment alike
        # inv_freq is a non-persistent buffer: build the rotary embedding on each real device
        self.rotary = rotary_cls(config=config).to(device)
        self.rotaries = {dev: self.rotary if dev == device else rotary_cls(config=config).to(dev)
                         for dev in self.devices}
        params = inspect.signature(layer_cls.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        if compiled:  # a program per window, shape and segment, and not one more: dynamo's limits raised to fit
            attention.allow_recompiles(attention.RECOMPILES)
        self.compiled = compiled
        self.graphs = GraphTable(attention.compile_options() if compiled else None)  # keys: (tokens, logits, tree, segment)

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
        for seg in self._segments:
            if any(module is layer for layer in seg.layers):
                return seg.device
        return self.last_device if module is self.norm or module is self.lm_head else self.device

    @classmethod
    def load(cls, source: ModelSource, lo: int, hi: int, *, embed: bool, head: bool,
             dtype: torch.dtype, device: torch.device, max_len: int,
             progress: Progress = _no_progress, quant: str = "none",
             devices: list[torch.device] | None = None, reserved=(), rows: int | None = None,
             compiled: bool = False) -> "ModelSlice":
        check_mode(quant)
        sl = cls(source.config, lo, hi, embed=embed, head=head, dtype=dtype, device=device, max_len=max_len,
                 devices=devices, quant=quant, reserved=reserved, rows=rows, compiled=compiled)
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
        single = len(set(sl.devices) | {device}) == 1  # read straight onto the one device
        dev = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
        for name, tensor in source.read(names, dev if single else "cpu", progress):
            if name in wanted:
                module, attr = wanted[name]
                tensor = tensor.to(sl.device_of(module)).to(dtype)
                state.setdefault(module, {})[attr] = tensor
                if len(state[module]) == expected[module]:  # complete: load it (and quantise a layer) now
                    module.load_state_dict(state.pop(module), strict=True, assign=True)
                    if quant != "none" and module in layers:
                        quantize_linears(module, dtype, quant)
            if name == head_name:  # a tied head shares the embedding's weight when on the same device
                shared = name in wanted and sl.embed_tokens is not None and sl.last_device == sl.device
                sl.lm_head.weight = sl.embed_tokens.weight if shared else nn.Parameter(
                    tensor.to(sl.last_device).to(dtype), requires_grad=False)
        for module, sd in state.items():  # incomplete modules: strict loading names what is missing
            module.load_state_dict(sd, strict=True, assign=True)
        for p in sl.parameters():
            p.requires_grad_(False)
        left = [n for n, p in sl.named_parameters() if p.is_meta]
        if left:
            raise UserError(f"checkpoint {source.name!r} did not provide {left[0]}")
        return sl.eval()

    # -- compute -------------------------------------------------------------------------------
    def capture(self, n_tokens: int, n_logits: int = 0, log=None, tree: bool = False, span: int | None = None
                ) -> bool:
        """Capture the ``n_tokens`` forward (a tree forward with ``tree``, its queries seeing the
        ``span`` slots from the mask's base: ``n_tokens`` unless given) as CUDA graphs, one per
        attention window that can hold it and per segment, each on its segment's device (before
        any conversation); True when every segment has its graphs."""
        key = self._key(n_tokens, n_logits, tree)
        span = n_tokens if span is None else span
        if span < n_tokens:
            raise ValueError(f"a tree forward of {n_tokens} tokens cannot see only {span} slots")
        windows = self.windows if self.canonical else [w for w in self.windows if w >= span]  # kv: any window
        done = []
        for i, dev in enumerate(self.devices):
            if i == 0 and self.embed_tokens is not None:
                x = torch.zeros(n_tokens, dtype=torch.long, device=dev)
            else:
                x = torch.zeros(n_tokens, self.config.hidden_size, dtype=self.dtype, device=dev)
            positions = torch.arange(n_tokens, device=dev)
            inputs = (x, positions)
            if tree and self.canonical:  # a chain as example: each row's last positions at slot = position
                inputs += (positions.clone(), causal_keys(positions))
            elif tree:  # a chain as example: rope = slots, base 0, each token sees its predecessors
                inputs += (positions.clone(), positions[:1].clone(),
                           torch.ones(n_tokens, span, dtype=torch.bool, device=dev).tril())
            lo, hi = self.ranges[i]
            what = f"{n_tokens}-token {'tree ' if tree else ''}forward of layers [{lo}, {hi})"
            done.append(self.graphs.capture(key + (i,), what, self._segment(i, n_logits, tree), inputs, windows,
                                            log))
        return all(done)

    def _key(self, n_tokens: int, n_logits: int, tree: bool) -> tuple[int, int, bool]:
        return n_tokens, n_logits if self.lm_head is not None else 0, tree

    def captured(self, n_tokens: int, n_logits: int = 0, tree: bool = False) -> bool:
        """Whether that forward replays from graphs (one per segment)."""
        key = self._key(n_tokens, n_logits, tree)
        return all(key + (i,) in self.graphs for i in range(len(self._segments)))

    @torch.no_grad()
    def run(self, x: torch.Tensor, positions: torch.Tensor, n_logits: int = 0, *, end: int | None = None,
            tree: TreeMask | RowKeys | None = None) -> torch.Tensor:
        """``forward`` over the smallest window holding positions below ``end`` (all slots when
        None), each segment replayed from its captured graph when one fits the shape; a one-shape
        slice refuses another row count (a ValueError)."""
        if self.rows and x.shape[0] != self.rows:
            raise ValueError(f"a forward of {x.shape[0]} rows on a slice whose every forward runs at {self.rows}")
        window = self.window_for(end) if end is not None else self.max_len
        return self._through(x, positions, n_logits, window, tree, self._key(x.shape[0], n_logits, tree is not None))

    @torch.no_grad()
    def feed(self, x: torch.Tensor, start: int, chunk: int = PREFILL_CHUNK) -> torch.Tensor | None:
        """Write positions ``start ..`` of ``x`` (token ids or hidden states) to the caches as plain
        forwards: pieces of the slice's one row count, the last padded with rows that write the
        sink slot, or (no ``rows``) of up to ``chunk``. A one-shape slice runs each piece as the tree
        forward of a chain at slot = position (the same ``Attend`` as a plain forward's: the same
        arithmetic), so that the captured verify graph replays it (its key: ``rows`` rows, tree, and
        with the head as many logits), never the eager kernels one by one. The real rows' hidden
        states, or None for a slice with the head (its logits are computed and nobody reads them)."""
        size, n_logits, outs = self.rows or chunk, int(self.lm_head is not None), []
        for i in range(0, x.shape[0], size):
            piece = x[i:i + size]
            n = piece.shape[0]
            positions = torch.arange(start + i, start + i + n, device=x.device)
            rows = None
            if self.rows:  # a chain at slot = position is a tree forward: the verify's own graph replays it
                if n < self.rows:
                    piece = torch.cat([piece, piece.new_zeros((self.rows - n,) + piece.shape[1:])])
                    positions = torch.cat([positions, positions.new_full((self.rows - n,), self.max_len)])
                rows, n_logits = RowKeys(positions, causal_keys(positions)), n_logits and self.rows
            out = self.run(piece, positions, n_logits, end=start + i + n, tree=rows)
            outs.append(out[:n])
        return None if self.lm_head is not None else torch.cat(outs)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, positions: torch.Tensor, n_logits: int = 0,
                window: int | None = None, tree: TreeMask | RowKeys | None = None) -> torch.Tensor:
        return self._through(x, positions, n_logits, window, tree, None)

    def _through(self, x, positions, n_logits, window, tree, key) -> torch.Tensor:
        """The segments one after the other, each on its device: the plain functions, or (with
        ``key``) the table's graph of each that fits."""
        inputs = (x, positions, *(tree.tensors() if tree is not None else ()))
        for i, dev in enumerate(self.devices):
            inputs = tuple(t.to(dev) for t in inputs)  # the hidden state moves to the next segment's device
            fn = self._segment(i, n_logits, tree is not None)
            out = fn(*inputs, window) if key is None else self.graphs.run(key + (i,), fn, inputs, window)
            inputs = (out,) + inputs[1:]
        return out.to(self.device)

    def _segment(self, i: int, n_logits: int, tree: bool):
        """Segment ``i``'s forward as a plain function of tensors and the window: what ``capture``
        captures and ``run`` calls where nothing was captured."""
        def fn(h, positions, *args):  # (h, positions, [rope, base, visible,] window)
            *tensors, window = args
            rows = (RowKeys if self.canonical else TreeMask)(*tensors) if tree else None
            return self._layers(i, h, positions, n_logits, window, rows)
        return fn

    def _layers(self, i: int, h: torch.Tensor, positions: torch.Tensor, n_logits: int, window: int | None,
                tree: TreeMask | RowKeys | None) -> torch.Tensor:
        seg = self._segments[i]
        dev, kv, layers = seg.device, seg.kv, seg.layers
        if i == 0:
            h = self.embed_tokens(h) if self.embed_tokens is not None else h.to(self.dtype)
        h = h[None]
        pos = (tree.rope if tree is not None else positions)[None]
        rope = self.rotaries[dev](h, pos)
        mask = kv.begin(positions, window, tree)
        kw = {self._cache_kw: kv}
        for layer in layers:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope, **kw)
            if isinstance(h, tuple):  # older transformers return (hidden,)
                h = h[0]
        if i + 1 < len(self._segments) or self.lm_head is None:
            return h[0]
        return self.lm_head(self.norm(h[0, -n_logits:])).float()

    # -- the K/V: every segment's cache at once -------------------------------------------------
    @property
    def max_len(self) -> int:
        """Slots per cache: the context and the scratch after it."""
        return self._segments[0].kv.max_len

    @property
    def windows(self) -> list[int]:
        """The attention windows a forward may run over (``kv.windows_for``)."""
        return self._segments[0].kv.windows

    def window_for(self, end: int) -> int:
        """The smallest window holding positions ``0 .. end - 1``."""
        return self._segments[0].kv.window_for(end)

    @property
    def held(self) -> int:
        """Positions of the context whose tokens the caches hold (``note``)."""
        return len(self._written)

    def cached_tokens(self) -> list[int]:
        """The tokens whose K/V the caches hold at slots ``0 .. held - 1`` (a copy)."""
        return list(self._written)

    def note(self, start: int, tokens) -> None:
        """Record that the K/V of ``tokens`` sits at slots ``start``... in every segment; later slots
        become stale. Writing past the held context is a hole: a ValueError."""
        if start > len(self._written):
            raise ValueError(f"KV hole: writing at {start} but only {len(self._written)} slots are filled")
        del self._written[start:]
        self._written.extend(int(t) for t in tokens)

    def reusable(self, tokens) -> int:
        """Length of the longest prefix of ``tokens`` whose K/V the caches already hold.

        Called every round over the whole context: prefix equality is monotone, so a binary
        search of list-slice comparisons (done in C) replaces a Python loop over every token."""
        tokens, written = list(tokens), self._written
        n = min(len(written), len(tokens))
        if written[:n] == tokens[:n]:
            return n
        lo, hi = 0, n  # written[:lo] matches, written[:hi] does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if written[lo:mid] == tokens[lo:mid]:
                lo = mid
            else:
                hi = mid
        return lo

    def move(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of slots ``src`` to slots ``dst`` in every layer of every segment (sources
        all read before any destination is written). What the moved slots hold is the caller's to
        ``note``."""
        for seg in self._segments:
            seg.kv.move(src, dst)

    def reset(self, zero: bool = False) -> None:
        """Forget what the slots hold; ``zero`` also clears every segment's buffers."""
        self._written.clear()
        if zero:
            for seg in self._segments:
                seg.kv.clear()

    def attend_in_blocks(self, block: int, from_window: int) -> None:
        """Tree forwards over a window of at least ``from_window`` slots attend in blocks of ``block``
        (``kv.StaticKV.in_blocks``: the draft's), in every segment; graphs capture the form set then."""
        for seg in self._segments:
            seg.kv.in_blocks(block, from_window)

    def fuse_projections(self) -> int:
        """Merge each layer's q/k/v and gate/up GEMMs (``model.fused``: the draft's, never a target
        slice's, whose arithmetic must stay the reference's), before any capture; layers fused."""
        if self.canonical or self.graphs:
            raise ValueError("only a draft's slice, before its graphs are captured, has its projections merged")
        return sum(fused.fuse(layer) for layer in self.layers)

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every layer's keys, then values, segment by segment (the buffers themselves: for checks)."""
        return [t for seg in self._segments for t in seg.kv.keys + seg.kv.values]


@dataclass(eq=False)
class _Segment:
    """A run of the slice's layers on one device, with the K/V cache of those layers."""

    device: torch.device
    kv: StaticKV
    layers: list[nn.Module]
