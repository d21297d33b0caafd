"""ModelSource never runs a checkpoint's own code, and opens names from the network only inside
the directories its operator allowed."""

from __future__ import annotations

import builtins
import json

import pytest

from sfchat import UserError
from sfchat.model import source
from sfchat.model.source import ModelSource, allowed_local_dir


def custom_code_model(path):
    """A checkpoint whose config asks for custom code (``auto_map``) that leaves a mark when run."""
    path.mkdir()
    marker = path / "custom-code-ran"
    (path / "config.json").write_text(json.dumps({
        "model_type": "sfchat-custom", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}))
    (path / "configuration_custom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PretrainedConfig\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'sfchat-custom'\n")
    return marker


def test_a_checkpoint_with_custom_code_is_refused_without_asking_on_stdin(tmp_path, monkeypatch):
    """Today's finding: transformers asked "Do you wish to run the custom code? [y/N]" on the tail's
    stdin; whoever (or whatever) answered yes ran the checkpoint's code."""
    marker = custom_code_model(tmp_path / "custom")
    asked = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "y")
    with pytest.raises(UserError, match="cannot read the config"):
        ModelSource.open(str(tmp_path / "custom"))
    assert asked == [] and not marker.exists()


def test_names_from_the_network_resolve_inside_the_allowed_dirs_only(tmp_path):
    root = tmp_path / "models"
    (root / "org" / "model").mkdir(parents=True)
    (root / "plain").mkdir()
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    assert allowed_local_dir(str(root / "plain"), [root]) == (root / "plain").resolve()
    assert allowed_local_dir("plain", [root]) == (root / "plain").resolve()
    assert allowed_local_dir("org/model", [root]) == (root / "org" / "model").resolve()
    assert allowed_local_dir("Qwen/Qwen2.5-7B-Instruct", [root]) is None  # a hub id
    assert allowed_local_dir("gpt2", []) is None
    assert allowed_local_dir("link", [root]) is None  # leads out of the root: only a hub id by its syntax
    for name in (str(tmp_path / "outside"), str(root / "link"), "../outside", "/etc", "/", "", "a/b/c", "~/x", "./plain/..",
                 str(root), "x" * 2000, "bad\0name"):
        with pytest.raises(UserError, match="inside its --models-dir"):
            allowed_local_dir(name, [root])


def test_a_hub_id_from_the_network_never_touches_a_local_directory_of_that_name(tmp_path, monkeypatch):
    (tmp_path / "org" / "model").mkdir(parents=True)  # in the working directory, not an allowed dir
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(source, "hub_unreachable", lambda: "no network in this test")
    with pytest.raises(UserError, match="not in the local cache"):
        ModelSource.open("org/model", allowed_dirs=[])
    # the head's own names (no allowed_dirs) still open local directories
    with pytest.raises(UserError, match="has no config.json"):
        ModelSource.open("org/model")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors",
                                   "C:\\x.safetensors", "~/x.safetensors", "a\x1b[2J.safetensors", ""])
def test_a_weight_index_naming_files_outside_the_model_directory_is_refused(zoo, tmp_path, shard):
    """Round four: a checkpoint's index could name shards outside its directory (absolute or ../)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(zoo["llama-tied"], model)
    (tmp_path / "outside.safetensors").write_bytes((model / "model.safetensors").read_bytes())
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model.safetensors", "lm_head.weight": shard}}))
    with pytest.raises(UserError, match="naming the shard"):
        ModelSource.open(str(model))


def test_a_weight_index_naming_shards_inside_the_directory_is_used(zoo, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(zoo["llama-tied"], model)
    (model / "sub").mkdir()
    (model / "model.safetensors").rename(model / "sub" / "model-00001.safetensors")
    from safetensors import safe_open

    with safe_open(str(model / "sub" / "model-00001.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "sub/model-00001.safetensors" for n in names}}))
    src = ModelSource.open(str(model))
    assert set(src.weight_map.values()) == {"sub/model-00001.safetensors"}
