"""Single hostile frames that used to kill ``sfchat --tail`` or tell a head about the tail's disk:
each is now one ERROR (a TailError), and the same Verifier serves the next honest head."""

from __future__ import annotations

import os

import pytest
import torch

from sfchat.engine.verifier import Verifier
from sfchat.node.tail_loader import TailLoader
from sfchat.protocol.wire import HEADER, MAGIC, PROTOCOL_VERSION, DType, Forward, MsgType, Sampling, decode, encode

from tail_cases import K, check_serves, hello_for, replies, tail_case  # noqa: F401  (the tail_case fixture)


def raw_hello(path, **raw_fields) -> bytes:
    """A HELLO whose JSON body carries ``raw_fields`` verbatim (what json.dumps would never write)."""
    good = decode(hello_for(path)).data
    fields = {k: v for k, v in good.items() if k not in raw_fields}
    parts = [f'"{k}":{"null" if v is None else repr(v).replace(chr(39), chr(34))}' for k, v in fields.items()]
    parts += [f'"{k}":{v}' for k, v in raw_fields.items()]
    body = ("{" + ",".join(parts) + "}").encode()
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.HELLO, 0, 0, len(body)) + body


@pytest.mark.parametrize("fields", [{"split": "Infinity"}, {"split": "1e999"}, {"n_layers": "1e999"},
                                    {"max_len": "NaN"}, {"hidden_size": "-Infinity"}, {"max_len": "1e999"},
                                    {"split": "1.5"}, {"hidden_size": "true"}, {"split": "true"},
                                    {"max_len": "1" + "0" * 30}, {"frames": "[1.5]"}, {"graphs": "1"}])
def test_a_hello_with_numbers_json_cannot_hold_or_of_the_wrong_type_is_refused(tail_case, fields):
    """An earlier finding: ``"k": Infinity`` (and 1e999) escaped the tail as OverflowError and killed it."""
    good, _, ref, fwd = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    message = replies(v, raw_hello(good, **fields), fails=True)
    assert "malformed frame" in message or "incomplete hello" in message, message
    check_serves(v, good, ref, fwd)


def test_a_hello_cannot_probe_the_tails_disk_or_load_outside_its_models_dir(tail_case, tmp_path):
    """Today's finding: a HELLO naming /etc opened it as a model ("no config.json") while a missing
    path said "does not exist": a head could map the tail's directories."""
    good, _, ref, fwd = tail_case
    v = Verifier(TailLoader(torch.device("cpu"), models_dirs=[tmp_path / "models"]))
    (tmp_path / "models").mkdir()
    answers = {}
    for name in ("/etc", "/no/such/directory", str(good), "../../etc", "/etc/passwd"):
        answers[name] = replies(v, hello_for(good, model=name), fails=True).replace(repr(name), "NAME")
    assert len(set(answers.values())) == 1, answers
    assert "loads hub ids and directories inside its --models-dir" in answers["/etc"]
    os.symlink(good, tmp_path / "models" / "escape")  # a link inside the allowed root that leads out of it
    assert "inside its --models-dir" in replies(v, hello_for(good, model=str(tmp_path / "models" / "escape")),
                                                fails=True)
    allowed = Verifier(TailLoader(torch.device("cpu"), models_dirs=[good.parent]))
    check_serves(allowed, good, ref, fwd)  # an absolute path inside the root
    relative = replies(allowed, hello_for(good, model=good.name), fails=False)  # a name relative to the root
    assert relative[-1].type is MsgType.READY
