"""What the memory estimate counts beyond weights and K/V, from the config alone, and when the
check runs: before a single weight is fetched, on the head and on the tail."""

from __future__ import annotations

import pytest
import torch

from sfchat import UserError
from sfchat.config import Settings
from sfchat.model.memory import per_device
from sfchat.model.source import ModelSource
from sfchat.protocol.handshake import Hello

from test_memory import gpus  # noqa: F401  (a fixture)


@pytest.fixture
def fetched(monkeypatch):
    """The shard files any source fetched (a fetch is where a hub model's weights download)."""
    names: list[str] = []
    real = ModelSource.fetch

    def fetch(self, wanted, progress=lambda *a: None):
        names.extend(wanted)
        return real(self, wanted, progress)

    monkeypatch.setattr(ModelSource, "fetch", fetch)
    return names


def test_the_head_refuses_what_does_not_fit_before_it_fetches_a_weight(zoo, gpus, fetched):
    from sfchat.node.loading import open_engine

    gpus[0] = gpus[1] = 64 << 20  # 64 MiB free: nothing fits
    s = Settings(model=str(zoo["qwen2-untied"]), draft=str(zoo["draft"]), device="cuda", dtype="float16", k=3)
    with pytest.raises(UserError, match=r"not enough GPU memory on cuda:\d: loading needs about"):
        open_engine(s)
    assert fetched == []


def test_the_tail_refuses_what_does_not_fit_before_it_fetches_a_weight(zoo, gpus, fetched):
    from sfchat.node.tail_loader import TailLoader

    gpus[0] = 64 << 20
    hello = Hello(model=str(zoo["qwen2-untied"]), revision=None, split=2, dtype="float16", max_len=128, n_layers=4,
                  hidden_size=64, frames=(9,))
    with pytest.raises(UserError, match=r"not enough GPU memory on cuda:0: .*tail layers"):
        TailLoader(torch.device("cuda:0"))(hello, lambda *a: None)
    assert fetched == []
