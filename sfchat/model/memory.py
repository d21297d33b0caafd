"""Will it fit? Each GPU's memory need against what is free there, before anything is loaded.

Contract
--------
The needs come from ``footprint.py`` (per segment of a slice, per CUDA graph). ``check_fits(plan,
hints)`` adds them up per CUDA device (``plan``: ``(what, device, Need)``, added by
``footprint.device_bytes``: one workspace and one graph pool per device), compares each sum
with what is free there (``torch.cuda.mem_get_info`` plus what torch's allocator holds unused) and
raises a ``UserError`` naming the device, the figures and ``hints`` (the fixes that apply to the
caller: 4-bit, a shorter context, a smaller --tree-budget, another split, another device). CPU devices
are not checked. ``SFCHAT_NO_MEMORY_CHECK=1`` skips every check (the estimate may be wrong for a
new GPU or driver).

``check_head`` is the head's check (its slice over ``devices``, the draft and its graphs, and in
local mode the tail's slice on the same devices), ``check_tail`` the tail's (its slice for the
verify shapes a HELLO announces), both before loading; ``head_plan`` / ``tail_plan`` are the needs
they check, per segment and device (``bench/layouts.py`` prints them). ``check_graphs(model,
verifies)`` is for a slice already loaded: the graphs that capturing those verify shapes would
add (shapes it holds already are not counted again), against the memory free now; a tail calls
it before capturing what a HELLO asks for (``graphs_to_capture`` lists them).

Placement over a node's GPUs: a slice's layers are cut so that every GPU keeps about the same
headroom (``decoder.segment_runs`` with ``reserved``: ``unequal_free`` for GPUs with less free
memory, and on the head ``head_reserve`` adds what the draft holds on its GPU); ``place_draft``
picks the draft's GPU when the head's layers use every GPU (see there for why that one). The
plans use the same cut as the slices are loaded with. This module loads nothing and knows
nothing about the wire.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from sfchat import UserError
from sfchat.model.footprint import (GIB, GRAPH_BYTES, Need, device_bytes, draft_graphs, gib, kv_bytes_per_position,
                                   slice_needs)
from sfchat.model.kv import draft_slots

Plan = list[tuple[str, torch.device, Need]]


@dataclass(frozen=True)
class DraftPlan:
    """The draft as the head will load and capture it (``Drafter``'s step: ``rows`` nodes, their
    ``children`` continuations each, ``pool`` scratch slots)."""

    config: object
    device: torch.device
    dtype: torch.dtype
    quant: str
    rows: int = 2
    children: int = 1
    pool: int = 2


def _cuda_key(device: torch.device) -> torch.device:
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def free_bytes(device: torch.device) -> int:
    """What a new allocation on ``device`` can get: free memory plus what torch holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def per_device(plan: Plan) -> dict[torch.device, tuple[int, list[tuple[str, Need]]]]:
    """The plan's CUDA devices: (bytes needed, the items there)."""
    items: dict[torch.device, list[tuple[str, Need]]] = {}
    for what, device, need in plan:
        if device.type == "cuda":
            items.setdefault(_cuda_key(device), []).append((what, need))
    return {device: (device_bytes(n for _, n in parts), parts) for device, parts in items.items()}


def check_fits(plan: Plan, hints: list[str]) -> None:
    """Raise a UserError when the needs of ``plan`` exceed the free memory of a CUDA device."""
    if os.environ.get("SFCHAT_NO_MEMORY_CHECK", "") not in ("", "0"):
        return
    for device, (total, items) in per_device(plan).items():
        free = free_bytes(device)
        if total <= free:
            continue
        parts = "; ".join(f"{what} {need.describe()}" for what, need in items)
        fixes = f" Try {', or '.join(hints)}." if hints else ""
        raise UserError(f"not enough GPU memory on {device}: loading needs about {gib(total)} ({parts}) but only "
                        f"{gib(free)} is free.{fixes} (The figure is an estimate: SFCHAT_NO_MEMORY_CHECK=1 "
                        "skips this check.)")


def _segments(what: str, needs: list[tuple[torch.device, Need]]) -> Plan:
    return [(what if len(needs) == 1 else f"{what} (part {i + 1} of {len(needs)})", d, n)
            for i, (d, n) in enumerate(needs)]


def _tree(verifies) -> int:
    return max((p - 1 for p, tree in verifies if tree), default=0)


def hints(role: str, *, quant: str, max_len: int, kv_per_position: int, gpus: int, spread: bool,
          draft: str | None = None, tree_budget: int = 0) -> list[str]:
    """The fixes that apply to ``role`` ("head", "tail" or "local"), most effective first."""
    on_head = " on the head" if role == "tail" else ""
    out = []
    if tree_budget:
        out.append(f"a smaller --tree-budget{on_head} (now {tree_budget}: each node adds a row of logits and a KV "
                   "slot; a GPU pads every frame to --frame-rows: lower it too)")
    if quant != "nf4":
        out.append("--load-in-4bit (NF4: the layers take about a quarter of their 16-bit size)" if role != "tail"
                   else "--load-in-4bit on the head (the tail follows it)")
    if quant == "none":
        out.append("--load-in-8bit (int8: about half their 16-bit size, faster frames than NF4)" if role != "tail"
                   else "--load-in-8bit on the head")
    out.append(f"a shorter --max-context{on_head} (now {max_len} positions, "
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


def draft_need(draft: DraftPlan, max_len: int, graphs: bool = True) -> Need:
    """The draft's weights, KV cache, workspace and graphs on its device (its cache of
    ``kv.draft_slots(max_len)`` slots, as the head loads it)."""
    max_len = draft_slots(max_len)
    [(_, need)] = slice_needs(draft.config, 0, int(draft.config.num_hidden_layers), embed=True, head=True,
                              dtype=draft.dtype, quant=draft.quant, max_len=max_len, devices=[draft.device],
                              graphs=False)
    captured = draft_graphs(draft.config, draft.dtype, draft.quant, max_len, rows=draft.rows, children=draft.children,
                            pool=draft.pool) if graphs and draft.device.type == "cuda" else ()
    return replace(need, graphs=captured)


def unequal_free(devices: list[torch.device]) -> list[int]:
    """Per entry of ``devices``: how much less is free there than on the roomiest of them (0 for
    the CPU): reserved in a slice's ``segment_runs``, so that its layers leave every GPU the same
    headroom (in local mode the tail then balances around what the head took)."""
    free = {d: free_bytes(_cuda_key(d)) for d in dict.fromkeys(devices) if d.type == "cuda"}
    most = max(free.values(), default=0)
    return [most - free[d] if d in free else 0 for d in devices]


def head_reserve(draft: DraftPlan | None, devices: list[torch.device], max_len: int, graphs: bool = True
                 ) -> list[int]:
    """``reserved`` for the head's slice over ``devices``: ``unequal_free``, and on the last entry
    naming the draft's GPU what the draft adds there (its weights, K/V and graph outputs: its
    workspace and graph temporaries fit in the head's), so that the layers balance around it."""
    out = unequal_free(devices)
    if draft is not None and draft.device in devices:
        need = draft_need(draft, max_len, graphs)
        adds = (need.weights + need.weights // 20 + need.fragments + need.kv
                + sum(g.outputs + GRAPH_BYTES for g in need.graphs))
        out[len(devices) - 1 - devices[::-1].index(draft.device)] += adds
    return out


def head_plan(config, split: int, *, devices: list[torch.device], dtype: torch.dtype, quant: str, max_len: int,
              verifies, draft: DraftPlan | None = None, local: bool = False, graphs: bool = True,
              head_span: int = 0, one_shape: bool = False) -> Plan:
    """The head's needs: its slice over ``devices`` (graphs for ``verifies``, the (positions, tree)
    of the frame shape, each seeing ``head_span`` slots, its scratch pool; its layers balanced by
    ``head_reserve``), the draft and, in local mode,
    the tail's slice on the same devices (balanced around the head's, as ``TailLoader`` balances
    it around the memory free once the head is loaded)."""
    L = int(config.num_hidden_layers)
    common = dict(dtype=dtype, quant=quant, max_len=max_len, devices=devices, graphs=graphs, one_shape=one_shape)
    reserved = head_reserve(draft, devices, max_len, graphs)
    plan = _segments("head layers", slice_needs(config, 0, split, embed=True, head=False, verifies=verifies,
                                                reserved=reserved, span=head_span, **common))
    if draft is not None:
        plan.append(("draft", draft.device, draft_need(draft, max_len, graphs)))
    if local:  # the tail's slice loads next, balanced around what the head holds by then
        held = per_device(plan)
        taken = [u + (held.get(_cuda_key(d), (0, []))[0] if d.type == "cuda" else 0)
                 for u, d in zip(unequal_free(devices), devices)]
        plan += _segments("tail layers", slice_needs(config, split, L, embed=False, head=True, verifies=verifies,
                                                     reserved=taken, **common))
    return plan


def check_head(config, split: int, *, devices: list[torch.device], dtype: torch.dtype, quant: str, max_len: int,
               verifies, draft: DraftPlan | None = None, local: bool = False, graphs: bool = True,
               head_span: int = 0, one_shape: bool = False) -> None:
    """The head's check (``head_plan``); ``max_len`` counts the tree's scratch slots."""
    L = int(config.num_hidden_layers)
    plan = head_plan(config, split, devices=devices, dtype=dtype, quant=quant, max_len=max_len, verifies=verifies,
                     draft=draft, local=local, graphs=graphs, head_span=head_span, one_shape=one_shape)
    draft_hint = None
    if draft is not None:
        fixes = [] if draft.quant == "nf4" else ["--draft-load-in-4bit"]
        if draft.device in devices and _gpus() >= 2:
            fixes.append("--draft-device on the other GPU")
        draft_hint = ", ".join(fixes + ["--draft none"]) + " (the draft)"
    check_fits(plan, hints("local" if local else "head", quant=quant, max_len=max_len,
                           kv_per_position=kv_bytes_per_position(config, L if local else split, dtype),
                           gpus=_gpus(), spread=len(devices) > 1, draft=draft_hint, tree_budget=_tree(verifies)))


def tail_plan(config, split: int, *, devices: list[torch.device], dtype: torch.dtype, quant: str, max_len: int,
              verifies, graphs: bool = True, one_shape: bool = False) -> Plan:
    """The tail's needs: its slice over ``devices``, balanced by ``unequal_free`` (as ``TailLoader``
    loads it), with graphs for ``verifies``."""
    L = int(config.num_hidden_layers)
    return _segments("tail layers", slice_needs(config, split, L, embed=False, head=True, dtype=dtype, quant=quant,
                                                max_len=max_len, devices=devices, verifies=verifies, graphs=graphs,
                                                reserved=unequal_free(devices), one_shape=one_shape))


def _tail_hints(config, split: int, quant: str, max_len: int, dtype, verifies, spread: bool) -> list[str]:
    return hints("tail", quant=quant, max_len=max_len, spread=spread, gpus=_gpus(), tree_budget=_tree(verifies),
                 kv_per_position=kv_bytes_per_position(config, int(config.num_hidden_layers) - split, dtype))


def check_tail(config, split: int, *, devices: list[torch.device], dtype: torch.dtype, quant: str,
               max_len: int, verifies, graphs: bool = True, one_shape: bool = False) -> None:
    """The tail's check before loading: its slice, with graphs for the HELLO's ``verifies``."""
    check_fits(tail_plan(config, split, devices=devices, dtype=dtype, quant=quant, max_len=max_len,
                         verifies=verifies, graphs=graphs, one_shape=one_shape),
               _tail_hints(config, split, quant, max_len, dtype, verifies, len(devices) > 1))


def graphs_to_capture(model, verifies) -> Plan:
    """Per segment of a loaded ``ModelSlice``, the graphs that capturing ``verifies`` (each with as
    many rows of logits as positions in a slice with the head) adds to what it holds."""
    new = [(p, tree) for p, tree in verifies if not model.captured(p, p, tree)]
    needs = slice_needs(model.config, model.lo, model.hi, embed=model.embed_tokens is not None,
                        head=model.lm_head is not None, dtype=model.dtype, quant=model.quant,
                        max_len=model.max_len, devices=model.devices, verifies=new, one_shape=bool(model.rows))
    return [(f"CUDA graphs of layers [{lo}, {hi})", dev, Need(0, 0, 0, need.graphs))
            for (lo, hi), (dev, need) in zip(model.ranges, needs) if need.graphs]


def check_graphs(model, verifies) -> None:
    """Raise a UserError when the graphs for ``verifies`` that ``model`` has not captured yet would
    not fit in the memory free now (a second HELLO asking for new shapes, a tail's first)."""
    check_fits(graphs_to_capture(model, verifies),
               _tail_hints(model.config, model.lo, model.quant, model.max_len, model.dtype, verifies,
                           len(model.devices) > 1))


def place_draft(config, split: int, draft: DraftPlan, **target) -> DraftPlan:
    """``draft`` on the GPU of the head's ``devices`` that leaves the node the most memory (the
    least free after its needs, over all its GPUs, as large as it can be), the head's layers
    balanced around it (``head_plan(config, split, draft=..., **target)``); a tie goes to the
    last GPU. Compute does not decide it: one thread runs the draft and then the head's segments
    one after the other, on whichever GPUs they are, and the draft's tokens come back to the host
    every round either way. Memory does, but little: the layers rebalance around the draft
    wherever it goes (and around a GPU that something else uses too), so both choices end within
    about a layer of each other, and the estimate picks the better one."""
    gpus = list(dict.fromkeys(d for d in target["devices"] if d.type == "cuda"))
    if len(gpus) < 2:
        return draft

    def headroom(device):
        needs = per_device(head_plan(config, split, draft=replace(draft, device=device), **target))
        return min(free_bytes(d) - needs.get(_cuda_key(d), (0, []))[0] for d in gpus)

    return replace(draft, device=max(reversed(gpus), key=headroom))


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
