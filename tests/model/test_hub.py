"""Hub sources without a network: byte progress of shard downloads through a fake hub, and the
messages for what users get wrong (unknown id, gated repo, bad revision, offline with nothing
cached, a local directory the tail does not have)."""

from __future__ import annotations

import json

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants, errors

from sfchat import UserError
from sfchat.protocol import wire
from sfchat.model import source
from sfchat.model.source import ModelSource
from sfchat.engine.verifier import TailError, Verifier
from sfchat.node.tail_loader import TailLoader

import tinymodels

CHUNK = 1000


@pytest.fixture(scope="module")
def sharded(zoo, tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("hub") / "ckpt"
    tinymodels.make_model(path, "llama", AutoTokenizer.from_pretrained(zoo["tokenizer"]), seed=7,
                          max_shard_size="100KB")
    return path


def fake_hub(path, monkeypatch, log):
    """hf_hub_download serving ``path`` and driving the caller's tqdm class like the real one:
    one bar counting the file's bytes, then (as the xet path does) a second bar of network bytes."""
    def download(repo_id, filename, revision=None, tqdm_class=None, **kw):
        log.append(filename)
        src = path / filename
        if tqdm_class is not None:
            size = src.stat().st_size
            bar = tqdm_class(total=size, desc=filename, unit="B", unit_scale=True, initial=0)
            transfer = tqdm_class(total=None, desc=f"{filename}: downloading bytes", unit="B")
            for done in range(0, size, CHUNK):
                bar.update(min(CHUNK, size - done))
                transfer.update(7)
            bar.close()
            transfer.close()
        return str(src)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)


def test_shard_downloads_report_their_bytes(sharded, monkeypatch):
    asked = []
    fake_hub(sharded, monkeypatch, asked)
    src = ModelSource.open("acme/tiny", "main")
    events = []
    names = ["model.layers.0.mlp.up_proj.weight", "model.layers.3.mlp.down_proj.weight"]
    src.fetch(names, lambda *e: events.append(e))
    files = sorted({src.weight_map[n] for n in names})
    assert len(files) == 2 and asked[-2:] == files
    for i, f in enumerate(files):
        detail = f"{f} ({i + 1}/2)"
        mine = [e for e in events if e[3] == detail]
        size = (sharded / f).stat().st_size
        assert mine[0] == ("download", 0, 0, detail)  # a file starts: size not known yet
        assert mine[-1] == ("download", size, size, detail)  # and ends complete
        done = [e[1] for e in mine[1:]]
        assert done == sorted(done) and all(e[2] == size for e in mine[1:])  # bytes only grow; no xet jumps
    assert events[-1] == ("download", 2, 2, "")


def raising(exc):
    def download(*args, **kw):
        raise exc
    return download


def hub_error(cls, message="boom"):
    exc = cls.__new__(cls)  # these errors want an HTTP response object; the message is all that matters here
    Exception.__init__(exc, message)
    return exc


@pytest.mark.parametrize("cls, message", [
    (errors.RepositoryNotFoundError, r"model 'acme/nope' was not found on the Hugging Face hub \(check the id"),
    (errors.GatedRepoError, r"model 'acme/nope' is gated: accept its licence on https://huggingface.co/acme/nope "
                            r"and log in with a token .*HF_TOKEN"),
    (errors.RevisionNotFoundError, r"revision 'v9' not found for model 'acme/nope' \(check --revision\)"),
])
def test_hub_refusals_name_the_fix(monkeypatch, cls, message):
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", raising(hub_error(cls)))
    with pytest.raises(UserError, match=message):
        ModelSource.open("acme/nope", "v9")


@pytest.fixture(autouse=True)
def hub_reachable(monkeypatch):
    """Tests below decide whether the hub answers; the machine running them may have no network."""
    monkeypatch.setattr(source, "hub_unreachable", lambda: None)


def test_no_network_and_nothing_cached(monkeypatch):
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        raising(errors.LocalEntryNotFoundError("cannot reach the hub, nothing cached")))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(UserError, match=r"not in the local cache and the hub cannot be reached: check the network "
                                        r"\(on Kaggle, turn the notebook's Internet setting on\)"):
        ModelSource.open("acme/nope")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="HF_HUB_OFFLINE=1 forbids downloading it: unset HF_HUB_OFFLINE"):
        ModelSource.open("acme/nope")


def test_really_offline_with_an_empty_cache(monkeypatch, tmp_path):
    """No fake: huggingface_hub itself, offline, with an empty cache."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="'Qwen/Qwen2.5-7B-Instruct' is not in the local cache"):
        ModelSource.open("Qwen/Qwen2.5-7B-Instruct")


def test_a_tail_told_of_a_directory_it_does_not_have(tmp_path):
    hello = {"model": str(tmp_path / "only-on-the-head"), "revision": None, "split": 2, "dtype": "float32",
             "max_len": 32, "n_layers": 4, "hidden_size": 64, "k": 2}
    out = []
    with pytest.raises(TailError, match="does not exist on the tail machine .*give the head a hub id, or the same "
                                        "directory on both machines"):
        Verifier(TailLoader(torch.device("cpu"))).handle(wire.encode(wire.Control(wire.MsgType.HELLO, hello)), out.append)
    assert json.loads(json.dumps(wire.decode(out[-1]).data))["message"].startswith("tail cannot load")



@pytest.fixture
def unprobed(monkeypatch):
    """The real probe, not yet run in this process, with connections counted."""
    monkeypatch.undo()  # drop hub_reachable's stand-in
    monkeypatch.setattr(source, "_probe_result", [])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for var in source.PROXY_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    tries = []

    def no_dns(address, timeout=None):
        tries.append(address)
        raise OSError(-2, "Name or service not known")

    monkeypatch.setattr(source.socket, "create_connection", no_dns)
    return tries


def test_an_unreachable_hub_means_the_cache_only_and_an_error_at_once(unprobed, monkeypatch, sharded, capsys):
    """No retries for half a minute: one probe, then local_files_only for every file (huggingface_hub
    alone would retry for about 23 s)."""
    calls = []

    def cache_only(repo_id, filename, revision=None, local_files_only=False, **kw):
        calls.append(local_files_only)
        if repo_id == "acme/cached" and local_files_only and (sharded / filename).exists():
            return str(sharded / filename)
        raise errors.LocalEntryNotFoundError(f"{filename} is not cached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", cache_only)
    with pytest.raises(UserError, match=r"'acme/nope' is not in the local cache and the hub cannot be reached "
                                        r"\(cannot connect to huggingface.co:443: Name or service not known\): "
                                        r"check the network"):
        ModelSource.open("acme/nope")
    src = ModelSource.open("acme/cached")
    assert src.local_files_only and src.weight_map and calls and all(calls)
    assert "hub cannot be reached (cannot connect to huggingface.co:443" in capsys.readouterr().err
    assert unprobed == [("huggingface.co", 443)]  # probed once for the whole process


def test_the_probe_is_skipped_behind_a_proxy_or_when_offline_is_asked_for(unprobed, monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert source.hub_unreachable() is None
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert source.hub_unreachable() is None
    assert unprobed == []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert "Name or service not known" in source.hub_unreachable()
