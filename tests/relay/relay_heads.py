"""What the relay security tests share: a head's settings for a relay, and a head opened and
asked through one."""

from __future__ import annotations

from pathlib import Path

from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.protocol import wire

from machines import PROMPT
from threaded_relay import TOKEN


SECRET = "3-harbor-lantern"


def settings(url: str, session: str, model, **changes) -> Settings:
    base = dict(relay=url, token=TOKEN, session=session, secret=SECRET, model=str(model), draft="none", k=0,
                device="cpu", reconnect_timeout=0.0, models_dir=str(Path(model).parent))
    base.update(changes)
    return Settings(**base)


def open_head(s: Settings, events: list):
    from sfchat.node.head import Head
    from sfchat.node.connect import connect_relay

    return Head.open(s, events.append, connect_relay(s, events.append, 30))


def reply(session, n: int = 12):
    ids = session.encode([{"role": "user", "content": PROMPT}])
    return [e for e in session.reply(ids, n, wire.Sampling()) if isinstance(e, ReplyFinished)][0], ids
