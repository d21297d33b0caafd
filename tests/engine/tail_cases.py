"""What the tail's tests share: a tiny model's HELLO, its greedy reference, tree frames for it,
and a check that a tail serves them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sfchat.engine.speculator import hidden_bytes
from sfchat.engine.verifier import TailError, Verifier
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.protocol.wire import Control, DType, Forward, MsgType, Verdict, decode, encode


SPLIT = 2
PROMPT = [3, 17, 42, 99, 5, 250, 7]
K = 3


def hello_for(path, **changes) -> bytes:
    data = {"model": str(path), "revision": None, "split": SPLIT, "dtype": "float32", "max_len": 64,
            "n_layers": 4, "hidden_size": 64, "frames": [K + 1, 8]}
    data.update(changes)
    return encode(Control(MsgType.HELLO, data))


def replies(verifier: Verifier, raw: bytes, fails: bool):
    out: list[bytes] = []
    if fails:
        with pytest.raises(TailError) as info:
            verifier.handle(raw, out.append)
        msgs = [decode(f) for f in out]
        # one ERROR, last; a hello may have reported loading PROGRESS before it
        assert [m.type for m in msgs] == [MsgType.PROGRESS] * (len(msgs) - 1) + [MsgType.ERROR], msgs
        assert msgs[-1].data["message"] == str(info.value)
        return msgs[-1].data["message"]
    verifier.handle(raw, out.append)
    return [decode(f) for f in out]


def greedy_reference(path, ids, n):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)
    return out[0, len(ids):].tolist()


def head_of(path) -> ModelSlice:
    return ModelSlice.load(ModelSource.open(str(path)), 0, SPLIT, embed=True, head=False, dtype=torch.float32,
                           device=torch.device("cpu"), max_len=64)


def tree_frames(path, ids, nodes, first_id=1, tree=1, rnd=1, known=None, prefill=True, sampling=None):
    """What a head sends a tail for a tree's frame: the context but its last token as a prefill
    FORWARD (for a tree's first frame), then the nodes ``(parent id, token)`` as the tree FORWARD,
    with the head slice's hidden state of each node computed over its whole path (``known``:
    id -> token path of nodes of earlier frames; updated)."""
    head = head_of(path)
    known = {0: []} if known is None else known
    frames = []
    n = len(ids)
    if prefill:
        pre = head(torch.tensor(ids[:-1]), torch.arange(n - 1))
        frames.append(encode(Forward(rnd, tree, 0, tuple(ids[:-1]), hidden_bytes(pre, "x"), DType.FLOAT32, 64)))
    rows = []
    for i, (parent, token) in enumerate(nodes):
        seq = ids[:-1] + known[parent] + [token]
        known[first_id + i] = known[parent] + [token]
        rows.append(head(torch.tensor(seq), torch.arange(len(seq)))[-1])
    hidden = torch.stack(rows)
    frames.append(encode(Forward(rnd, tree, n - 1, tuple(t for _, t in nodes), hidden_bytes(hidden, "x"), DType.FLOAT32,
                                 64, parents=tuple(p for p, _ in nodes), first_id=first_id,
                                 **({"sampling": sampling} if sampling else {}))))
    return frames


def chain(ids, drafts):
    """The nodes of a tree's first frame that is a chain: the root (the context's last token), then drafts."""
    return [(i, t) for i, t in enumerate([ids[-1]] + list(drafts))]


@pytest.fixture(scope="module")
def tail_case(zoo):
    """Two same-shaped checkpoints with different weights, and the first one's greedy continuation."""
    good, other = zoo["qwen2-untied"], zoo["qwen2-tied"]
    ref = greedy_reference(good, PROMPT, K + 1)
    assert ref != greedy_reference(other, PROMPT, K + 1)  # else the checks below could not tell them apart
    return good, other, ref, tree_frames(good, PROMPT, chain(PROMPT, ref[:K]))


def check_serves(verifier: Verifier, path, ref, frames, hello: bool = True) -> None:
    """The verifier answers the prefill and the tree frame as the reference says (after a fresh
    hello unless ``hello`` is False)."""
    if hello:
        ready = replies(verifier, hello_for(path), fails=False)
        assert ready[-1].type is MsgType.READY and ready[-1].data["n_layers"] == 4
    assert replies(verifier, frames[0], fails=False) == []  # the prefill
    (verdict,) = replies(verifier, frames[1], fails=False)
    assert isinstance(verdict, Verdict)
    assert verdict.path == tuple(range(K + 1)) and list(verdict.tokens) == ref  # every node committed
