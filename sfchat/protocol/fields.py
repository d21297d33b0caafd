"""Checks of the JSON objects a peer sends, field by field: each check written once for the protocols.

Contract
--------
Every metadata body that crosses a link (HELLO and READY, PROGRESS and ERROR, the chat messages of
``protocol.chat``) is a JSON object from an untrusted peer. ``required(data, key)`` is a field that
must be there; ``text``, ``integer``, ``number``, ``flag``, ``array`` and ``ints`` return a field
when it has its exact JSON type (a bool is no int, a float no int) within the bounds given;
``json_field`` is the handshake's one-call form (a type or types, a default, a range, choices).
Each raises ``wire.WireError`` naming the field and what is wrong with it, never another exception;
``shown`` puts a peer's value into such a message (its repr, which escapes control characters,
cut short). ``cut`` shortens a text of one's own to its bound before it is sent. The messages
differ between the two families (``json_field``'s are the handshake's, the others the chat
protocol's) and are kept as they are: peers and people read them. Torch-free; imports nothing of
sfchat but the wire's error.
"""

from __future__ import annotations

from sfchat.protocol.wire import WireError

MAX_EXACT = (1 << 53) - 1  # JSON numbers stay exact below this
MAX_NAME_CHARS = 512  # a string ``json_field`` takes: model ids, revisions, devices


def shown(value) -> str:
    """A value from the network, fit for a message: its repr (escapes control characters), cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def required(data: dict, key: str):
    if key not in data:
        raise WireError(f"no {key!r}")
    return data[key]


def text(data: dict, key: str, most: int, empty: bool = True, choices: tuple[str, ...] = ()) -> str:
    value = required(data, key)
    if type(value) is not str:
        raise WireError(f"{key}={shown(value)} is not a string")
    if len(value) > most or (not empty and not value):
        raise WireError(f"{key} of {len(value)} characters (1..{most})" if not empty else
                        f"{key} of {len(value)} characters (at most {most})")
    if choices and value not in choices:
        raise WireError(f"{key}={shown(value)} is none of {', '.join(choices)}")
    return value


def integer(data: dict, key: str, lo: int = 0, hi: int = MAX_EXACT) -> int:
    value = required(data, key)
    if type(value) is not int or not lo <= value <= hi:
        raise WireError(f"{key}={shown(value)} is not a whole number in {lo}..{hi}")
    return value


def number(data: dict, key: str, lo: float, hi: float) -> float:
    value = required(data, key)
    if type(value) not in (int, float) or not lo <= value <= hi:  # also refuses NaN
        raise WireError(f"{key}={shown(value)} is not a number in {lo:g}..{hi:g}")
    return float(value)


def flag(data: dict, key: str) -> bool:
    value = required(data, key)
    if type(value) is not bool:
        raise WireError(f"{key}={shown(value)} is not true or false")
    return value


def array(data: dict, key: str, most: int) -> list:
    value = required(data, key)
    if type(value) is not list or len(value) > most:
        raise WireError(f"{key} is not a list of at most {most} items")
    return value


def ints(data: dict, key: str, most: int, hi: int = (1 << 31) - 1) -> tuple[int, ...]:
    items = array(data, key, most)
    if any(type(i) is not int or not 0 <= i <= hi for i in items):
        raise WireError(f"{key} holds something other than whole numbers in 0..{hi}")
    return tuple(items)


def cut(value: str, most: int) -> str:
    return value if len(value) <= most else value[:most]


def json_field(data: dict, key: str, kind, default=..., lo: int = 0, hi: int = 0, choices=None, label=None):
    """``data[key]`` of type ``kind`` (a type or a tuple of types; ``default`` where it is missing),
    an int or float in ``lo..hi``, a string of 1..MAX_NAME_CHARS characters, one of ``choices``."""
    value = required(data, key) if default is ... else data.get(key, default)
    if type(value) not in (kind if isinstance(kind, tuple) else (kind,)):
        raise WireError(f"{key}={shown(value)} is not of the expected type")
    if type(value) is int and not lo <= value <= hi:
        raise WireError(f"{key}={value} out of range {lo}..{hi}")
    if type(value) is float and not lo <= value <= hi:  # also refuses NaN
        raise WireError(f"{key}={value} out of range {lo}..{hi}")
    if type(value) is str and not 0 < len(value) <= MAX_NAME_CHARS:
        raise WireError(f"{key} of {len(value)} characters")
    if choices is not None and value not in choices:
        raise WireError(f"unknown {label or key} {shown(value)} (one of {', '.join(choices)})")
    return value
