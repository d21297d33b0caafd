"""Single hostile frames that used to kill ``sfchat --tail`` or tell a head about the tail's disk:
each is now one ERROR (a TailError), and the same Verifier serves the next honest head."""

from __future__ import annotations

import os

import pytest
import torch

from sfchat.engine.verifier import Verifier
from sfchat.node.loading import TailLoader
from sfchat.protocol.wire import HEADER, MAGIC, PROTOCOL_VERSION, DType, Forward, MsgType, Sampling, decode, encode
from test_tail import K, check_serves, hello_for, replies, tail_case  # noqa: F401  (the tail_case fixture)


def raw_hello(path, **raw_fields) -> bytes:
    """A HELLO whose JSON body carries ``raw_fields`` verbatim (what json.dumps would never write)."""
    good = decode(hello_for(path)).data
    fields = {k: v for k, v in good.items() if k not in raw_fields}
    parts = [f'"{k}":{"null" if v is None else repr(v).replace(chr(39), chr(34))}' for k, v in fields.items()]
    parts += [f'"{k}":{v}' for k, v in raw_fields.items()]
    body = ("{" + ",".join(parts) + "}").encode()
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.HELLO, 0, 0, len(body)) + body


@pytest.mark.parametrize("fields", [{"k": "Infinity"}, {"k": "1e999"}, {"n_layers": "1e999"}, {"k": "NaN"},
                                    {"hidden_size": "-Infinity"}, {"max_len": "1e999"}, {"k": "1.5"},
                                    {"k": "true"}, {"split": "true"}, {"max_len": "1" + "0" * 30}])
def test_a_hello_with_numbers_json_cannot_hold_or_of_the_wrong_type_is_refused(tail_case, fields):
    """Today's finding: ``"k": Infinity`` (and 1e999) escaped the tail as OverflowError and killed it."""
    good, _, ref, fwd = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    message = replies(v, raw_hello(good, **fields), fails=True)
    assert "malformed frame" in message or "incomplete hello" in message, message
    check_serves(v, good, ref, fwd)


def test_a_sampled_verify_without_proposals_or_with_broken_ones_is_refused(tail_case):
    """Today's finding: temperature > 0 with drafts and no q' raised ValueError out of the tail."""
    good, _, ref, fwd = tail_case
    v = Verifier(TailLoader(torch.device("cpu")))
    replies(v, hello_for(good), fails=False)
    msg = decode(fwd)
    hot = Sampling(temperature=0.8, top_p=0.9, seed=7)
    bare = encode(Forward(1, 0, msg.tokens, msg.hidden, DType.FLOAT32, 64, n_draft=K, sampling=hot))
    assert "without the draft's proposal distributions" in replies(v, bare, fails=True)
    idx = bytes(4 * K)
    for bad in (float("nan"), float("inf"), -0.25):
        probs = torch.tensor([bad] + [0.5] * (K - 1), dtype=torch.float32).numpy().tobytes()
        broken = encode(Forward(1, 0, msg.tokens, msg.hidden, DType.FLOAT32, 64, n_draft=K, sampling=hot, n_q=1,
                                q_indices=idx, q_probs=probs))
        assert "not finite and non-negative" in replies(v, broken, fails=True)
    more = encode(Forward(1, 0, msg.tokens + (1,), msg.hidden + msg.hidden[:64 * 4], DType.FLOAT32, 64,
                          n_draft=K + 1))
    assert f"the hello announced at most {K}" in replies(v, more, fails=True)
    (verdict,) = replies(v, fwd, fails=False)
    assert list(verdict.tokens) == ref


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
