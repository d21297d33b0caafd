"""The README's table of what fits where is the estimator's: one row recomputed by
``bench/layouts.py`` and compared with the README, and its longest context checked against the
memory checks the nodes run (every GPU fits at that context, one does not 256 tokens later)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from sfchat import UserError
from sfchat.model import memory

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import layouts  # noqa: E402


@pytest.fixture
def t4s(monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: layouts.T4_FREE)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("SFCHAT_NO_MEMORY_CHECK", raising=False)


def test_the_readme_row_of_qwen25_32b_nf4_is_the_estimators(t4s):
    model = ("Qwen2.5-32B", "32B", "nf4", "none")
    line = layouts.table([layouts.row(*model)]).splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert line in readme.splitlines(), f"README's layout table is out of date: {line}"


def test_the_longest_context_of_two_notebooks_is_where_the_checks_start_to_refuse(t4s):
    cfg = layouts.config("32B")  # int8: in NF4 the model's own limit fits since the prefill runs in 64-row pieces
    longest = layouts.longest("32B", "int8", "none", "split")
    assert 4096 < longest < layouts.MAX_CONTEXT

    def check(context):  # what the head's open_engine and the tail's loader check, with those settings
        [draft] = [d for what, d, _ in layouts.plans("32B", "int8", context)["head"] if what == "draft"]
        target = dict(devices=layouts.GPUS, dtype=torch.float16, quant="int8", verifies=layouts.VERIFIES,
                      max_len=context + layouts.LAYOUT.scratch, one_shape=bool(layouts.LAYOUT.rows))
        plan = memory.DraftPlan(layouts.draft_config(), draft, torch.float16, "none", rows=layouts.LAYOUT.width + 1,
                                children=layouts.LAYOUT.children, pool=layouts.LAYOUT.draft_pool)
        memory.check_head(cfg, 32, draft=plan, **target)
        memory.check_tail(cfg, 32, **target)

    check(longest)
    with pytest.raises(UserError, match="not enough GPU memory on cuda:"):
        check(longest + 256)
