"""A node's heap after loading: frozen out of the collector's scans on a GPU; full collections timed."""

from __future__ import annotations

import gc

from sfchat.config import Settings
from sfchat.node import heap
from sfchat.node.head import Head


def test_settle_collects_then_freezes_what_is_alive():
    class Cycle:
        pass

    kept, dead = Cycle(), Cycle()
    kept.me, dead.me = kept, dead
    del dead  # garbage in a cycle: settle collects it rather than freezing it for good
    before = gc.get_freeze_count()
    try:
        heap.settle()
        assert gc.get_freeze_count() > before
        assert sum(type(o) is Cycle for o in gc.get_objects()) == 0  # frozen ones are not listed: kept is
        gc.unfreeze()
        assert sum(type(o) is Cycle for o in gc.get_objects()) == 1  # kept, alive; the cycle was collected
    finally:
        gc.unfreeze()


def test_full_collections_are_timed_until_stopped():
    watch = heap.FullCollections()
    try:
        gc.collect(0)
        gc.collect(1)  # younger generations do not count
        assert watch.ms == []
        gc.collect()
        gc.collect()
        assert len(watch.ms) == 2 and all(ms >= 0 for ms in watch.ms)
    finally:
        out = watch.stop()
    gc.collect()
    assert len(out) == 2 and watch._observe not in gc.callbacks


def test_a_cpu_head_and_its_local_tail_leave_the_heap_as_it_is(zoo, monkeypatch):
    """Only a GPU node settles (a process that loads model after model, as the CPU tests do, would
    keep every frozen cycle for good)."""
    calls = []
    monkeypatch.setattr(heap, "settle", lambda: calls.append(1))
    session = Head.open(Settings(model=str(zoo["qwen2-untied"]), draft=str(zoo["draft"]), k=2, device="cpu"))
    assert session.engine.link is not None and calls == []
