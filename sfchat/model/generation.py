"""A model's own sampling defaults, read from its ``generation_config.json``.

Contract: ``generation_defaults(source)`` returns the sampling settings the model's authors ship
as a ``params.GenParams`` (``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``; the keys
the file sets, the others None), as transformers' ``generate()`` and vLLM take them: a file whose
``do_sample`` is false (or absent, transformers' default) asks for greedy decoding and gives a
temperature of 0.0 (and its ``repetition_penalty``, which generate() applies to greedy decoding
too); no file (or one that cannot be read) gives ``GenParams()``, nothing set. The file comes from a directory or a hub repository somebody else made,
so it is hostile: it is read only up to ``MAX_BYTES``, parsed by transformers'
``GenerationConfig`` (a file it refuses counts as none), and each value must pass the same
``config.RULES`` as a flag or the config file; a value that does not (a temperature of 50, a
``top_k`` of ``"20"``, NaN) is left out, and ``notes`` says so in one line per value left out,
each plain text. The repetition penalty keeps sampling exact because the tail applies it from
each node's own context (``engine.sampling``); the other processors (``no_repeat_ngram_size``,
``min_p``...) are not read.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from sfchat.config import RULES
from sfchat.params import GenParams
from sfchat.plaintext import plain

FILE = "generation_config.json"
MAX_BYTES = 64 << 10  # a real one is under 1 KiB
KEYS = ("temperature", "top_p", "top_k")  # read when the file asks to sample
PENALTY = "repetition_penalty"  # read either way: generate() applies it to greedy decoding too


class Defaults(NamedTuple):
    values: GenParams  # within config.RULES (params.BOUNDS); None where the file sets nothing
    notes: tuple[str, ...] = ()  # values left out, and why, for the user


def generation_defaults(source) -> Defaults:
    """The sampling defaults of ``source`` (a ``model.source.ModelSource``)."""
    try:
        path = source.file(FILE, optional=True)
    except (FileNotFoundError, OSError):
        return Defaults(GenParams())
    except Exception as exc:  # the hub refused or failed: the model runs without its defaults
        return Defaults(GenParams(), (f"{FILE} of {plain(source.name)} could not be fetched: {plain(exc)[:200]}",))
    with open(path, "rb") as f:
        raw = f.read(MAX_BYTES + 1)
    return parse(raw, plain(source.name))


def parse(raw: bytes, name: str = "the model") -> Defaults:
    """The defaults in the bytes of a ``generation_config.json`` (see the module's contract)."""
    from transformers import GenerationConfig

    if len(raw) > MAX_BYTES:
        return Defaults(GenParams(), (f"{FILE} of {name} is over {MAX_BYTES >> 10} KiB: not read",))
    try:
        data = json.loads(raw.decode("utf-8"))
        if type(data) is not dict:
            raise ValueError("not a JSON object")
        config = GenerationConfig.from_dict(dict(data))
    except Exception as exc:  # any refusal of a hostile file: the model runs without its defaults
        return Defaults(GenParams(), (f"{FILE} of {name} is not a generation config ({plain(type(exc).__name__)}): not read",))
    values, notes = {}, []
    keys = KEYS + (PENALTY,)
    if config.do_sample is not True:
        values["temperature"], keys = 0.0, (PENALTY,)
    for key in keys:
        if key not in data or data[key] is None:
            continue
        try:
            values[key] = RULES[key].check(data[key])
        except ValueError as exc:
            notes.append(f"{FILE} of {name}: {key} {plain(exc)}; left out")
    return Defaults(GenParams(**values), tuple(notes))
