"""The tail's slice loader: what a HELLO may make a tail open, check and load.

Contract: ``TailLoader(device, devices, models_dirs, log)`` is the callable a ``Verifier`` is
given (by ``sfchat --tail`` and by local mode alike): it opens the model a HELLO names, refuses
what this tail may not open or cannot hold (a ``UserError``, answered to the head as an ERROR)
and loads the tail's slice; ``shapes(model, hello, progress)`` then captures a CUDA graph per frame shape
the hello names (canonical attention compiled or not, as the hello says: set when the slice
is loaded), after checking that memory holds them (refused as ``tail cannot capture the
head's frame shapes: ...``), or drops the graphs when the head runs without them; on a GPU it
then settles the heap (``heap.settle``). Capturing reports ``("capture", done, shapes, detail)``
to ``progress`` before each shape and once all are done, and a slice whose forwards compile
whole (``--compile-frames``: a minute or more at a first start) says so in the tail's log, with the
time it took. It knows nothing of the head's engine.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from sfchat import UserError
from sfchat.model import attention
from sfchat.model.decoder import n_layers
from sfchat.model.devices import DTYPE_NAMES, pick_dtype, runnable_dtype
from sfchat.model.memory import check_graphs, check_tail, unequal_free
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.node import heap
from sfchat.protocol import wire
from sfchat.protocol.handshake import Hello

QUANT_WORDS = {"nf4": " with NF4 weights", "int8": " with int8 weights"}


class TailLoader:
    """The tail's slice loader, handed to its ``Verifier``: opens the model a HELLO names (hub ids,
    and local directories inside ``models_dirs`` only; anywhere when None, as in local mode,
    whose names the user typed), checks the memory it needs, loads layers [split, L) with the
    norm and lm_head on ``device`` (spread over ``devices``, balanced so that every GPU is left the
    same headroom: ``memory.unequal_free``)."""

    def __init__(self, device: torch.device, devices: list[torch.device] | None = None,
                 models_dirs: list[Path] | None = None, log: Callable[[str], None] | None = None):
        self.device, self.devices = device, list(devices or [device])
        self.models_dirs = models_dirs
        self.log = log or (lambda message: None)

    def __call__(self, hello: Hello, progress: Callable) -> ModelSlice:
        def report(stage, done, total, detail):
            if stage == "download" and total == 0 and detail:  # a shard starts: worth a line on the tail too
                self.log(f"fetching {detail}")
            progress(stage, done, total, detail)

        heap.thaw()  # the model let go (the verifier holds none now) is freed whole, before another is loaded
        attention.compile_on_gpu(hello.compiled_attention)  # the head's setting: one code for both halves
        try:
            src = ModelSource.open(hello.model, hello.revision, report, allowed_dirs=self.models_dirs)
        except UserError as exc:
            if str(exc).startswith("model directory"):  # the head runs a local copy: so must the tail
                raise UserError(f"{exc} on the tail machine (the head named a local directory: give the "
                                "head a hub id, or the same directory on both machines)") from None
            raise
        L = n_layers(src.config)
        split = hello.split
        if not 0 <= split <= L:
            raise UserError(f"split {split} out of range 0..{L}")
        limit = (getattr(src.config, "max_position_embeddings", 0) or 1 << 20) + wire.MAX_SCRATCH
        if hello.max_len > limit:  # a head must not make the tail allocate without bound
            raise UserError(f"a context of {hello.max_len} positions exceeds the model's {limit}")
        asked = pick_dtype(self.device, hello.dtype)
        dtype = runnable_dtype(self.device, asked)
        if dtype != asked:
            self.log(f"{self.device} has no native {DTYPE_NAMES[asked]}: computing in {DTYPE_NAMES[dtype]} "
                     f"(the head's hidden states are converted; replies may differ slightly from an "
                     f"all-{DTYPE_NAMES[asked]} run)")
        quant = hello.quant
        where = ",".join(map(str, self.devices))
        check_tail(src.config, split, devices=self.devices, dtype=dtype, quant=quant, max_len=hello.max_len,
                   verifies=hello.shapes(), graphs=hello.graphs, one_shape=hello.one_shape)
        self.log(f"loading {hello.model} layers [{split}, {L}) as {DTYPE_NAMES[dtype]}"
                 f"{QUANT_WORDS.get(quant, '')} on {where}")
        return ModelSlice.load(src, split, L, embed=False, head=True, dtype=dtype, device=self.device,
                               max_len=hello.max_len, progress=report, quant=quant, devices=self.devices,
                               reserved=unequal_free(self.devices), rows=hello.rows, compiled=hello.compiled_frames)

    def shapes(self, model: ModelSlice, hello: Hello, progress: Callable = lambda *a: None) -> None:
        """Graphs for the hello's frame shapes on a GPU, if memory holds them; none without. On a
        GPU the heap is then settled (``heap.settle``: the slice, its compiled code and graphs live
        as long as the tail, out of the collector's scans)."""
        if not hello.graphs:
            model.graphs.clear()
        elif model.device.type == "cuda":
            try:
                check_graphs(model, hello.shapes())
            except UserError as exc:
                raise UserError(f"tail cannot capture the head's frame shapes: {exc}") from None
            todo = [(m, is_tree) for m, is_tree in hello.shapes() if not model.captured(m, m, is_tree)]
            for i, (m, is_tree) in enumerate(todo):
                what = f"{m}-row {'tree ' if is_tree else ''}frame"
                if model.compiled:
                    n = len(model.windows)
                    what += (f" (compiling its forward for {n} attention window{'s' if n != 1 else ''}: "
                             "a minute or more at the first start)")
                    self.log(f"{what}...")
                progress("capture", i, len(todo), what)
                t0 = time.perf_counter()
                # a verify sees its rows' slots and the trash slot
                model.capture(m, m, log=self.log, tree=is_tree, span=m + 1 if is_tree else None)
                if model.compiled:
                    self.log(f"the {m}-row frame compiled and captured in {time.perf_counter() - t0:.0f} s")
            if todo:
                progress("capture", len(todo), len(todo), "")
        if model.device.type == "cuda":
            heap.settle()
