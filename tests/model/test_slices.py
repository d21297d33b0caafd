"""Loading model slices: only the needed shards, parity with transformers, KV rewind, dtype, refusals."""

from __future__ import annotations

import json
import re
import shutil

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import tinymodels
from sfchat import UserError
from sfchat.model.kv import StaticKV
from sfchat.model.slices import ModelSlice
from sfchat.model.devices import pick_dtype
from sfchat.model.source import INDEX_FILE, ModelSource

CPU = torch.device("cpu")
L, SPLIT = 4, 2
IDS = [1, 17, 42, 99, 5, 250, 7, 300, 64, 12, 88, 3]
CASES = [("qwen3", True), ("qwen3", False), ("llama", True), ("llama", False)]
CASE_IDS = [f"{f}-{'tied' if t else 'untied'}" for f, t in CASES]


@pytest.fixture(scope="module")
def sharded(zoo, tmp_path_factory):
    """Tiny checkpoints saved in many small shards (one or two per layer), tied and untied."""
    tok = AutoTokenizer.from_pretrained(zoo["tokenizer"])
    root = tmp_path_factory.mktemp("sharded")
    paths = {}
    for i, (family, tied) in enumerate(CASES):
        path = root / f"{family}-{tied}"
        tinymodels.make_model(path, family, tok, seed=40 + i, tied=tied, layers=L, max_shard_size="100KB")
        paths[(family, tied)] = path
    return paths


_reference: dict = {}


def reference(path):
    """transformers' own forward of the whole model: (hidden_states per layer, logits) for IDS."""
    if path not in _reference:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            out = model(torch.tensor([IDS]), output_hidden_states=True)
        _reference[path] = [h[0] for h in out.hidden_states], out.logits[0]
    return _reference[path]


def load(path, lo, hi, *, embed, head, max_len=32):
    return ModelSlice.load(ModelSource.open(str(path)), lo, hi, embed=embed, head=head, dtype=torch.float32,
                           device=CPU, max_len=max_len)


def weight_map(path) -> dict[str, str]:
    return json.loads((path / INDEX_FILE).read_text())["weight_map"]


def layer_of(name: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def head_needs(name: str) -> bool:
    layer = layer_of(name)
    return name == "model.embed_tokens.weight" or (layer is not None and layer < SPLIT)


def tail_needs(name: str, tied: bool) -> bool:
    layer = layer_of(name)
    return (name in ("model.norm.weight", "lm_head.weight") or (layer is not None and layer >= SPLIT)
            or (tied and name == "model.embed_tokens.weight"))


def shards(path) -> dict[str, list[str]]:
    by_file: dict[str, list[str]] = {}
    for name, f in weight_map(path).items():
        by_file.setdefault(f, []).append(name)
    return by_file


def copy_without(path, dest, drop) -> list[str]:
    """A copy of the checkpoint without the shards whose every tensor satisfies ``drop``."""
    shutil.copytree(path, dest)
    gone = [f for f, names in shards(path).items() if all(drop(n) for n in names)]
    for f in gone:
        (dest / f).unlink()
    return gone


# -- slices read only their own shards and match transformers -----------------------------------

@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_head_slice_never_opens_the_tails_shards(sharded, case, tmp_path):
    family, tied = case
    path = sharded[case]
    wmap = weight_map(path)
    assert ("lm_head.weight" in wmap) is not tied  # tied checkpoints carry no lm_head at all
    assert len(shards(path)) >= 6
    gone = copy_without(path, tmp_path / "ckpt", lambda n: not head_needs(n))
    assert gone, "no shard holds only tail tensors: the checkpoint is not sharded finely enough"

    head = load(tmp_path / "ckpt", 0, SPLIT, embed=True, head=False)
    assert head.lm_head is None and head.norm is None and len(head.layers) == SPLIT
    hidden = head(torch.tensor(IDS), torch.arange(len(IDS)))
    states, _ = reference(path)
    torch.testing.assert_close(hidden, states[SPLIT], rtol=1e-4, atol=1e-4)
    # the deleted shards were real: the tail cannot be loaded from this copy
    with pytest.raises(UserError, match="missing shard"):
        load(tmp_path / "ckpt", SPLIT, L, embed=False, head=True)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_tail_slice_never_opens_the_heads_shards(sharded, case, tmp_path):
    family, tied = case
    path = sharded[case]
    gone = copy_without(path, tmp_path / "ckpt", lambda n: not tail_needs(n, tied))
    assert gone
    assert any(n == "model.embed_tokens.weight" for f in gone for n in shards(path)[f]) is not tied

    tail = load(tmp_path / "ckpt", SPLIT, L, embed=False, head=True)
    assert tail.embed_tokens is None and len(tail.layers) == L - SPLIT
    states, logits = reference(path)
    n = len(IDS)
    out = tail(states[SPLIT], torch.arange(n), n_logits=n)
    assert out.shape == (n, logits.shape[-1]) and out.dtype == torch.float32
    torch.testing.assert_close(out, logits, rtol=1e-4, atol=1e-4)
    wmap = weight_map(path)
    full = load_file(path / wmap["lm_head.weight" if not tied else "model.embed_tokens.weight"])
    expected_head = full["lm_head.weight" if not tied else "model.embed_tokens.weight"]
    assert torch.equal(tail.lm_head.weight, expected_head)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_whole_model_slice_and_last_n_logits(sharded, case):
    path = sharded[case]
    model = load(path, 0, L, embed=True, head=True)
    _, logits = reference(path)
    out = model(torch.tensor(IDS), torch.arange(len(IDS)), n_logits=3)
    torch.testing.assert_close(out, logits[-3:], rtol=1e-4, atol=1e-4)


def test_fetch_downloads_only_the_shards_that_hold_the_names(sharded, monkeypatch):
    path = sharded[("llama", False)]
    wmap = weight_map(path)
    requested = []

    def fake_download(repo_id, filename, revision=None, **kw):  # a hub that serves the tiny checkpoint
        requested.append(filename)
        assert repo_id == "acme/tiny-llama" and revision == "v1"
        assert (path / filename).is_file(), f"asked for {filename}, which the repository does not have"
        return str(path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    src = ModelSource.open("acme/tiny-llama", "v1")
    assert src.local_dir is None and src.weight_map == wmap
    assert requested == ["config.json", INDEX_FILE]

    requested.clear()
    names = ["model.layers.3.mlp.up_proj.weight", "model.norm.weight", "model.layers.3.input_layernorm.weight"]
    paths = src.fetch(names)
    want = {wmap[n] for n in names}
    assert set(paths) == want and sorted(requested) == sorted(want)
    assert all(p == path / f for f, p in paths.items())
    assert dict(src.read(names, "cpu")).keys() == set(names)

    requested.clear()
    head = ModelSlice.load(src, 0, SPLIT, embed=True, head=False, dtype=torch.float32, device=CPU, max_len=16)
    want = {f for n, f in wmap.items() if head_needs(n)}
    assert sorted(requested) == sorted(want)  # each needed shard once, nothing of the tail
    assert not want & {f for n, f in wmap.items() if layer_of(n) is not None and layer_of(n) >= SPLIT + 1}
    assert head.embed_tokens is not None

    with pytest.raises(UserError, match="lacks tensor 'model.layers.9.mlp.up_proj.weight'"):
        src.fetch(["model.norm.weight", "model.layers.9.mlp.up_proj.weight"])


# -- the static KV cache --------------------------------------------------------------------------

def test_static_kv_moves_every_layers_slots_in_one_call(monkeypatch):
    """A verdict moves the committed keys and values of every layer: one index_copy over the
    cache's one buffer, not four calls a layer (each a kernel launch and a dispatch on the head's
    host, every verdict); overlapping sources and destinations read before written."""
    kv = StaticKV(3, 2, 4, 16, torch.float32, CPU)
    for buf in kv.keys + kv.values:
        buf.copy_(torch.randn(buf.shape))
    before = [buf.clone() for buf in kv.keys + kv.values]
    calls = []
    index_copy = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda self, *a: calls.append(1) or index_copy(self, *a))
    kv.move([5, 6, 7, 3], [4, 5, 6, 3])  # overlapping, and one slot that stays
    assert len(calls) == 1
    for old, new in zip(before, kv.keys + kv.values):
        assert torch.equal(new[:, :, [4, 5, 6]], old[:, :, [5, 6, 7]])
        keep = [i for i in range(16) if i not in (4, 5, 6)]
        assert torch.equal(new[:, :, keep], old[:, :, keep])
    kv.clear()
    assert not any(buf.any() for buf in kv.keys + kv.values)


def test_static_kv_writes_masks_and_bookkeeping():
    kv = StaticKV(2, 1, 2, 8, torch.float32, CPU)
    mask = kv.begin(torch.tensor([0, 1, 2]))
    assert mask.shape == (1, 1, 3, 8)
    visible = torch.arange(8)[None, :] <= torch.tensor([0, 1, 2])[:, None]
    assert torch.equal(mask[0, 0] == 0, visible)
    assert (mask[0, 0][~visible] == torch.finfo(torch.float32).min).all()
    k = torch.arange(1, 7, dtype=torch.float32).view(1, 1, 3, 2)
    keys, values = kv.update(k, -k, 1)
    # all slots by default, as views of the buffers (no copies)
    assert keys.shape == kv.keys[1].shape and keys.data_ptr() == kv.keys[1].data_ptr()
    assert values.data_ptr() == kv.values[1].data_ptr()
    assert torch.equal(keys[0, 0, :3], k[0, 0]) and torch.equal(values[0, 0, :3], -k[0, 0])
    assert not keys[0, 0, 3:].any() and not kv.keys[0].any()

    # rewind: rewrite position 1; slot 2 keeps its stale values (never cleared)
    kv.begin(torch.tensor([1]))
    kv.update(torch.full((1, 1, 1, 2), 7.0), torch.full((1, 1, 1, 2), 7.0), 1)
    assert torch.equal(kv.keys[1][0, 0, 1], torch.tensor([7.0, 7.0]))
    assert torch.equal(kv.keys[1][0, 0, 2], k[0, 0, 2])
    kv.clear()
    assert not any(t.any() for t in kv.keys + kv.values)


@pytest.mark.parametrize("segments", [1, 2])
def test_a_slices_record_of_its_context_is_one_for_every_segment(segments):
    """What the context slots hold, reuse and holes are the slice's, kept once for all its segments
    (built on the meta device: no weights needed)."""
    from tinymodels import config_for

    sl = ModelSlice(config_for("qwen2", 64), 0, 4, embed=True, head=False, dtype=torch.float32, device=CPU,
                    max_len=8, devices=[CPU] * segments)
    assert len(sl.devices) == segments and sl.held == 0
    sl.note(0, [10, 11, 12])
    assert [sl.reusable(t) for t in ([10, 11, 12, 13], [10, 11, 99], [10], [], [9])] == [3, 2, 1, 0, 0]
    sl.note(1, [21])  # a rewind: slot 2 is stale now
    assert sl.cached_tokens() == [10, 21] and sl.held == 2
    assert sl.reusable([10, 11, 12]) == 1 and sl.reusable([10, 21, 12]) == 2
    with pytest.raises(ValueError, match="KV hole: writing at 4 but only 2 slots are filled"):
        sl.note(4, [1])
    assert sl.cached_tokens() == [10, 21]  # a refused note changes nothing
    sl.note(2, [30, 31])  # right at the end is fine
    assert sl.cached_tokens() == [10, 21, 30, 31]
    for t in sl.kv_tensors():
        t.fill_(1.0)
    sl.reset()
    assert sl.reusable([10, 21]) == 0 and all(t.eq(1).all() for t in sl.kv_tensors())  # forgotten, not cleared
    sl.reset(zero=True)
    assert len(sl.kv_tensors()) == 2 * 4 and not any(t.any() for t in sl.kv_tensors())  # every segment's
    with pytest.raises(ValueError, match="KV hole"):
        sl.note(1, [5])


def test_forward_after_rewind_equals_a_fresh_slice(zoo):
    path = zoo["qwen3-untied"]
    first = IDS
    second = IDS[:5] + [70, 80, 90]
    slice_ = load(path, 0, L, embed=True, head=True)
    slice_(torch.tensor(first), torch.arange(len(first)), n_logits=1)
    slice_.note(0, first)
    start = slice_.reusable(second)
    assert start == 5
    out = slice_(torch.tensor(second[start:]), torch.arange(start, len(second)), n_logits=3)
    assert slice_.kv_tensors()[0][0, :, len(second):len(first)].abs().sum() > 0  # stale slots are still there

    fresh = load(path, 0, L, embed=True, head=True)
    torch.testing.assert_close(out, fresh(torch.tensor(second), torch.arange(len(second)), n_logits=3),
                               rtol=1e-4, atol=1e-4)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        expected = model(torch.tensor([second])).logits[0, -3:]
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    # one token at a time after a second rewind, as the decode loop does
    slice_.note(start, second[start:])
    third = second[:6] + [11]
    step = slice_(torch.tensor([third[-1]]), torch.tensor([6]), n_logits=1)
    with torch.no_grad():
        expected = model(torch.tensor([third])).logits[0, -1:]
    torch.testing.assert_close(step, expected, rtol=1e-4, atol=1e-4)


# -- dtypes ---------------------------------------------------------------------------------------

def test_pick_dtype(monkeypatch):
    assert pick_dtype(CPU) is torch.float32
    assert pick_dtype(CPU, "auto") is torch.float32
    for name, dtype in [("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)]:
        assert pick_dtype(CPU, name) is dtype
    with pytest.raises(UserError, match=r"unknown dtype 'float64' \(choose from auto, float32, float16, bfloat16\)"):
        pick_dtype(CPU, "float64")

    asked = []

    def bf16(supported):
        def probe(including_emulation=True):
            asked.append(including_emulation)
            return supported
        return probe

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", bf16(True))
    assert pick_dtype(cuda) is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", bf16(False))  # a T4: no native bf16
    assert pick_dtype(cuda) is torch.float16
    assert asked == [False, False]  # emulated bf16 does not count
    assert pick_dtype(cuda, "float32") is torch.float32


# -- what is refused, and how ------------------------------------------------------------------------

def test_unsupported_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64)).save_pretrained(
        tmp_path / "gpt2")
    src = ModelSource.open(str(tmp_path / "gpt2"))
    with pytest.raises(UserError, match=r"unsupported architecture 'gpt2'; sfchat supports qwen2, qwen3, llama"):
        ModelSlice.load(src, 0, 1, embed=True, head=False, dtype=torch.float32, device=CPU, max_len=8)


def test_checkpoints_sfchat_cannot_read(zoo, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no config.json: not a transformers model"):
        ModelSource.open(str(tmp_path / "empty"))

    legacy = tmp_path / "legacy"  # a pytorch_model.bin checkpoint
    legacy.mkdir()
    shutil.copy(zoo["llama-untied"] / "config.json", legacy)
    torch.save(load_file(zoo["llama-untied"] / "model.safetensors"), legacy / "pytorch_model.bin")
    with pytest.raises(UserError, match="has no safetensors weights .*reads safetensors checkpoints only"):
        ModelSource.open(str(legacy))

    (legacy / INDEX_FILE).write_text('{"metadata": {}}')
    with pytest.raises(UserError, match=f"malformed {re.escape(INDEX_FILE)}"):
        ModelSource.open(str(legacy))

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot read the config"):
        ModelSource.open(str(broken))

    monkeypatch.chdir(tmp_path)
    for name in ("./nope", str(tmp_path / "nope"), "a/b/c"):
        with pytest.raises(UserError, match=f"model directory {re.escape(repr(name))} does not exist"):
            ModelSource.open(name)


def test_attention_windows_cover_each_forward_with_the_fewest_slots(monkeypatch):
    from sfchat.model import kv as kv_module
    from sfchat.model.kv import windows_for

    assert windows_for(4105) == [512, 1024, 2048, 4096, 4105]
    assert windows_for(512) == [512] and windows_for(100) == [100] and windows_for(2048) == [512, 1024, 2048]
    assert windows_for(40, min_window=8) == [8, 16, 32, 40]
    monkeypatch.setattr(kv_module, "MIN_WINDOW", 4)
    kv = StaticKV(1, 1, 2, 20, torch.float32, CPU)
    assert kv.windows == [4, 8, 16, 20]
    assert [kv.window_for(e) for e in (1, 4, 5, 8, 9, 16, 17, 20)] == [4, 4, 8, 8, 16, 16, 20, 20]
    for bad in (0, 21):
        with pytest.raises(ValueError, match=f"ending at position {bad} does not fit a cache of 20 slots"):
            kv.window_for(bad)
    mask = kv.begin(torch.tensor([5, 6]), kv.window_for(7))
    assert mask.shape == (1, 1, 2, 8)
    assert torch.equal(mask[0, 0] == 0, torch.arange(8)[None, :] <= torch.tensor([5, 6])[:, None])
    keys, values = kv.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), 0)
    assert keys.shape == values.shape == (1, 1, 8, 2) and keys.data_ptr() == kv.keys[0].data_ptr()
    assert kv.keys[0][0, 0, 5:7].eq(1).all() and not kv.keys[0][0, 0, 7:].any()


@pytest.mark.parametrize("family", ["qwen2-untied", "llama-tied"])
def test_a_windowed_forward_equals_the_full_one(zoo, family, monkeypatch):
    """Masked slots add nothing: attending over 8 slots instead of 64 changes no output beyond
    float rounding, for prefill and for a verify-shaped forward.

    Compared in float64: a window changes the length and so the summation order of the
    attention's reductions, which in float32 moves logits of magnitude ~10 by a few dozen ulps
    (1.6e-5 seen on a 2-core CPU), too close to any fixed float32 tolerance. In float64 the same
    reordering stays below 1e-12, while one masked slot that leaked into the softmax would move
    the outputs by orders of magnitude more. The slice hands its logits back as float32, a
    rounding that may fall either side of a boundary for the two runs: one float32 ulp
    (rtol 2**-23) is allowed for that, and 1e-9 absolute for the float64 reordering."""
    from sfchat.model import kv as kv_module

    monkeypatch.setattr(kv_module, "MIN_WINDOW", 8)
    src = ModelSource.open(str(zoo[family]))
    full = ModelSlice.load(src, 0, 4, embed=True, head=True, dtype=torch.float64, device=CPU, max_len=64)
    assert full.windows == [8, 16, 32, 64]
    ids = torch.tensor([3, 17, 42, 99, 5, 250, 7, 11, 13, 19, 23])
    ref = full.forward(ids, torch.arange(11), 11)
    assert full.lm_head.weight.dtype == torch.float64
    for end in (6, 11):  # window 8, then 16
        got = full.run(ids[:end], torch.arange(end), end, end=end)
        torch.testing.assert_close(got, ref[:end], atol=1e-9, rtol=2 ** -23)
    full.run(ids[:6], torch.arange(6), 1, end=6)  # the context, then 5 positions like a verify
    got = full.run(ids[6:], torch.arange(6, 11), 5, end=11)
    torch.testing.assert_close(got, ref[6:], atol=1e-9, rtol=2 ** -23)
