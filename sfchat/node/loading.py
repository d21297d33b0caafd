"""Loading a node's models: the head's draft and slice behind a round driver, the tail's slice.

Contract
--------
``open_engine(settings, on_event, link, src, dsrc, policy, redial)`` resolves devices, dtype,
split and the frame layout, places the draft (``--draft-device``; else a GPU the head's layers do
not use; else, with the layers spread over every GPU, ``memory.place_draft``'s choice, the head's
layers then balanced around it), checks the memory every GPU needs (``memory.check_head``:
weights, KV cache, workspace and every graph the head will capture, the tail's too in local mode),
loads the draft and the head slice, captures their CUDA graphs, connects to the tail (in-process
through ``MemoryLink`` unless a relay link is given; a lost one is dialled again with ``redial``,
by default a fresh ``connect.HeadDialer``: hand in the dialer that made ``link`` so that a
restarted tail resumes its pairing) and returns ``(RoundDriver, RuntimeReady)``, reporting
``LoadProgress`` as it goes; ``policy`` replaces the pipeline policy. On a GPU, once its models
are loaded and captured, the head settles its heap (``heap.settle``: what loading made leaves the
cyclic collector's scans, whose full collections stalled frames 0.6-0.9 s); a head opened again in
the same process thaws it first (``heap.thaw``).
Token ids only: no tokenizer is needed (benchmarks use random-weight checkpoints).
``check_devices(settings)`` refuses a device this machine lacks, for a caller to run before it
fetches anything. Local mode's tail loads its slice through ``node.tail_loader.TailLoader``, as
``sfchat --tail`` does. Every failure a user can fix is a ``UserError``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable


from sfchat import UserError
from sfchat.config import Settings
from sfchat.engine.draft import CHILDREN, WIDTH, Drafter
from sfchat.engine.speculator import Speculator
from sfchat.engine.verifier import Verifier
from sfchat.events import LoadProgress, RuntimeReady
from sfchat.model import attention
from sfchat.model.decoder import n_layers
from sfchat.model.devices import DTYPE_NAMES, default_draft_device, pick_dtype, resolve_device, resolve_devices
from sfchat.model.kv import draft_slots
from sfchat.model.memory import DraftPlan, check_head, head_reserve, place_draft
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.node.connect import HeadDialer
from sfchat.node.driver import RoundDriver
from sfchat.node import heap
from sfchat.node.local_link import MemoryLink
from sfchat.node.tail_loader import TailLoader
from sfchat.protocol.handshake import Hello


def progress_events(on_event: Callable, node: str):
    return lambda stage, done, total, detail: on_event(LoadProgress(node, stage, done, total, detail))


def uses_draft(s: Settings) -> bool:
    return bool(s.draft) and s.draft.lower() != "none" and s.depth > 0


def check_devices(s: Settings) -> None:
    """Refuse a ``--device`` or ``--draft-device`` this machine lacks (a UserError naming the fix),
    before anything is fetched."""
    resolve_devices(s.device)
    if s.draft_device:
        resolve_device(s.draft_device)


def open_engine(s: Settings, on_event: Callable = lambda e: None, link=None,
                src: ModelSource | None = None, dsrc: ModelSource | None = None, policy=None,
                redial: Callable | None = None):
    """Load draft and head slice, capture graphs, connect to the tail: (RoundDriver, RuntimeReady).

    Token ids only: no tokenizer is needed (benchmarks use random-weight checkpoints)."""
    heap.thaw()  # a head opened again in one process: what the one before held is freed whole first
    devices = resolve_devices(s.device)
    device = devices[0]
    attention.compile_on_gpu(s.compile_attention)
    quant, dquant = s.quant(), ("nf4" if s.draft_load_in_4bit else "none")
    src = src or ModelSource.open(s.model, s.revision, progress_events(on_event, "head"))
    L = n_layers(src.config)
    split = L // 2 if s.split is None else s.split
    if not 0 <= split <= L:
        raise UserError(f"--split {split} is out of range: {s.model} has {L} layers (0..{L})")
    dtype = pick_dtype(device, s.dtype)
    limit = getattr(src.config, "max_position_embeddings", None) or s.max_context
    max_context = min(s.max_context, limit)
    k = s.depth if uses_draft(s) else 0
    drafter = None
    if k:
        dsrc = dsrc or ModelSource.open(s.draft, s.draft_revision, progress_events(on_event, "draft"))
    ahead = s.draft_ahead if k and link is not None and link.overlaps else 0  # local mode never waits on a wire
    layout = frame_layout(s, k, device.type == "cuda", ahead, local=link is None)
    if s.compile_frames and not layout.rows:
        raise UserError("--compile-frames compiles the target's one-shape forwards: it needs --frame-rows N "
                        "(on a GPU, auto does; 0 turns them off)")
    kv_len = max_context + layout.scratch  # the live nodes' scratch after the context
    hello = Hello(model=s.model, revision=s.revision, split=split, dtype=DTYPE_NAMES[dtype], max_len=kv_len,
                  n_layers=L, hidden_size=src.config.hidden_size, frames=(layout.shape,), graphs=s.cuda_graphs,
                  quant=quant, one_shape=bool(layout.rows),
                  compiled_attention=s.compile_attention, compiled_frames=s.compile_frames)
    local = link is None
    target = dict(devices=devices, dtype=dtype, quant=quant, max_len=kv_len, verifies=hello.shapes(), local=local,
                  graphs=s.cuda_graphs, head_span=layout.head_pool, one_shape=bool(layout.rows))
    draft = None
    if k:
        draft_device = resolve_device(s.draft_device) if s.draft_device else default_draft_device(devices)
        draft = DraftPlan(dsrc.config, draft_device, pick_dtype(draft_device, s.dtype), dquant,
                          rows=layout.width + 1, children=layout.children, pool=layout.draft_pool)
        if not s.draft_device and draft_device in devices:  # no spare GPU: where the estimate leaves most room
            draft = place_draft(src.config, split, draft, **target)
    check_head(src.config, split, draft=draft, **target)
    reserved = head_reserve(draft, devices, kv_len, s.cuda_graphs)  # before the draft takes its share
    if k:
        dmodel = ModelSlice.load(dsrc, 0, n_layers(dsrc.config), embed=True, head=True,
                                 dtype=draft.dtype, device=draft.device, max_len=draft_slots(kv_len),
                                 progress=progress_events(on_event, "draft"), quant=dquant)
        drafter = Drafter(dmodel, width=layout.width, children=layout.children, pool=layout.draft_pool)
    head = ModelSlice.load(src, 0, split, embed=True, head=False, dtype=dtype, device=device,
                           max_len=kv_len, progress=progress_events(on_event, "head"), quant=quant, devices=devices,
                           reserved=reserved, rows=layout.rows or None, compiled=s.compile_frames)
    if s.cuda_graphs and (device.type == "cuda" or (draft is not None and draft.device.type == "cuda")):
        capture_graphs(head, drafter, layout, s.compile_draft, progress_events(on_event, "head"))
    if any(d.type == "cuda" for d in devices) or (draft is not None and draft.device.type == "cuda"):
        heap.settle()  # what loading made lives as long as the head: out of the collector's scans
    mode = "relay" if link is not None else "local"
    if link is None:
        link = MemoryLink(Verifier(TailLoader(device, devices)))
    reconnect = (redial or HeadDialer(s, on_event)) if s.relay or s.direct else None
    spec = Speculator(head, drafter, max_context=max_context, frame_size=layout.size, steps=k,
                      head_pool=layout.head_pool)
    engine = RoundDriver(spec, link, policy=policy, on_event=on_event, reconnect=reconnect,
                         round_timeout=s.round_timeout, reconnect_timeout=s.reconnect_timeout,
                         max_in_flight=s.max_in_flight, ahead_steps=ahead)
    ready = engine.connect(hello, lambda *fields: on_event(LoadProgress("tail", *fields)))
    info = RuntimeReady(model=s.model, draft=s.draft if k else "none", split=split, n_layers=L,
                        dtype=DTYPE_NAMES[dtype], k=k, device=",".join(map(str, devices)), mode=mode,
                        max_context=max_context, quant=quant, tree_budget=s.budget(device.type == "cuda") if k else 0,
                        shapes=(str(layout),), max_in_flight=engine.policy.max_in_flight,
                        tail_dtype="" if ready.dtype == DTYPE_NAMES[dtype] else ready.dtype)
    on_event(info)
    return engine, info


@dataclass(frozen=True)
class FrameLayout:
    """What a frame and the scratch behind it look like: ``size`` nodes (the root and ``size - 1``
    drafts) verified at that one padded shape (``shape``: ``rows`` when every forward of the
    target runs at one row count, else ``size``); the draft expands ``width`` nodes per step and keeps
    ``children`` continuations of each (a chain: one and one); scratch slots for the live nodes on
    the head (``head_pool``: every frame in flight) and the draft (``draft_pool``)."""

    size: int
    width: int
    children: int
    head_pool: int
    draft_pool: int
    rows: int = 0  # every forward of the target at this row count (0: each at its own)

    @property
    def shape(self) -> int:
        return self.rows or self.size

    @property
    def scratch(self) -> int:
        return max(self.head_pool, self.draft_pool)

    def __str__(self) -> str:
        return f"chain {self.size - 1}" if self.children == 1 else f"tree {self.size - 1}"


def frame_layout(s: Settings, k: int, cuda: bool, ahead: int = 0, local: bool = False) -> FrameLayout:
    """The frame of these settings: ``--tree-budget`` drafts per frame (on a GPU, 63 under auto: a
    frame's cost is nearly flat in its nodes there up to 64 rows; on a CPU a chain), ``--k`` expansion steps,
    up to ``--max-in-flight`` frames in flight (one in ``local`` mode, whose tail computes while
    the head waits), ``ahead`` steps more while a verdict travels; ``--frame-rows``: the one row
    count of every forward of the target (``Settings.rows``)."""
    if not k:
        rows = s.rows(cuda, 1)
        return FrameLayout(1, 1, 1, max(1, rows) + 1, 2, rows)
    budget = s.budget(cuda)
    size, width, children = (budget + 1, WIDTH, CHILDREN) if budget else (k + 1, 1, 1)
    frames = (1 if local else s.max_in_flight) + 1  # those in flight and the one being built
    rows = s.rows(cuda, size)  # a frame padded to it sees its own rows' slots at least
    return FrameLayout(size, width, children, head_pool=max(frames * size, rows) + 1,
                       draft_pool=min((frames * k + ahead) * width, 512) + 1 if budget
                       else frames * (k + 1) + ahead + 1, rows=rows)


def capture_graphs(head: ModelSlice, drafter: Drafter | None, layout: FrameLayout, compile_draft: bool,
                   progress) -> None:
    """CUDA graphs for the steady state: the head slice over a frame, the draft's expansion step."""
    def warn(message):
        print(f"sfchat: {message}", file=sys.stderr)

    progress("capture", 0, 2, "head frame (compiling its forward for each attention window: a minute or more at the "
                              "first start)" if head.compiled else "head frame")
    head.capture(layout.shape, log=warn, tree=True, span=layout.head_pool)
    progress("capture", 1, 2, "draft (compiling it for each attention window: a minute or more at the first start)" if compile_draft else "draft")
    if drafter is not None and drafter.device.type == "cuda":
        drafter.capture(log=warn, compile=compile_draft)
    progress("capture", 2, 2, "")


def check_same_tokenizer(s: Settings, target_tok, draft_tok) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise UserError(f"the draft {s.draft!r} uses a different tokenizer than {s.model!r}: "
                        "pick a draft from the same model family, or --draft none")
