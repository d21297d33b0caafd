"""What the UI tests on a real model share: the real runtime worker, recording what it reports, its
settings for a tiny model, and one-shot's reply to compare the screen's with."""

from __future__ import annotations

from sfchat.config import Settings
from sfchat.events import ReplyFinished, ReplyStarted
from sfchat.node.head import Head
from sfchat.node.worker import RuntimeWorker
from sfchat.protocol.wire import Sampling

from pilots import Recording


class RecordingWorker(Recording, RuntimeWorker):
    """The real worker, keeping a copy of every event it reports."""

    def started(self) -> list[ReplyStarted]:
        return [e for e in self.events if isinstance(e, ReplyStarted)]


def one_shot_text(settings: Settings, prompt: str, n: int) -> str:
    session = Head.open(settings)
    ids = session.encode([{"role": "user", "content": prompt}])
    return [e for e in session.reply(ids, n, Sampling()) if isinstance(e, ReplyFinished)][0].text


def settings_for(zoo, model="llama-tied", **kw) -> Settings:
    return Settings(model=str(zoo[model]), draft=str(zoo["draft"]), k=3, device="cpu", **kw)
