"""A node's Python heap after loading: out of the cyclic collector's way. Torch-free.

Contract
--------
Loading a model, compiling its forwards and capturing their graphs leaves a node's process holding
hundreds of thousands to millions of Python objects that live as long as it does (on the 2-core
test machine a tiny model's head already held 450,000, and one full collection took 206 ms).
CPython's cyclic collector scans every tracked object on each full collection, and a reply's dead
speculation trees (nodes pointing at their parents and children: cycles) make one come now and
then: on an H100 the head's one full collection in a run took 901 ms mid-reply, every frame in
flight waiting on it (RESULTS, fourteenth session).

* ``settle()``: once loading is done (models, compiled programs, graphs), collect what loading
  left and freeze the rest (``gc.freeze``): a full collection from then on scans only what was made
  since. Called on a GPU (where the compiles and graphs are, and a frame's milliseconds count) by
  the head after it loads (``loading.open_engine``) and by a tail after it captures the hello's
  shapes (``tail_loader.TailLoader.shapes``); again after a later load (a new hello), it freezes
  what that load added. What it freezes was alive: a frozen object is freed as any other once
  nothing refers to it, only a cycle of frozen objects is never collected, so a process that loads
  model after model (the CPU tests) does not call it.
* ``thaw()``: before a node that settled loads another model in its place (a tail whose next head
  names another: ``TailLoader``; a head opened again in one process: ``loading.open_engine``),
  unfreeze and collect, so that the model let go is freed whole
  (a cycle of frozen objects would hold its memory, GPU memory included, for good). Nothing where
  nothing was frozen (no collection either: the CPU tests load model after model).
* ``FullCollections()``: from when it is made until ``stop()``, the wall time of every full
  collection (``ms``, a list): what a benchmark reports beside its figures.
"""

from __future__ import annotations

import gc
import time


def settle() -> None:
    gc.collect()
    gc.freeze()


def thaw() -> None:
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()


class FullCollections:
    def __init__(self) -> None:
        self.ms: list[float] = []
        self._start: float | None = None
        gc.callbacks.append(self._observe)

    def _observe(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.ms.append((time.perf_counter() - self._start) * 1e3)
            self._start = None

    def stop(self) -> list[float]:
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)
        return self.ms
