"""Pieces the GPU benchmarks share: model shapes, random checkpoints, a relay and a tail on loopback.

``write_checkpoint`` writes a random bf16 Qwen2 checkpoint in a given shape (no hub access), or
one whose greedy next token is a fixed permutation of the current one; ``relay_and_tail`` runs a
real sfchat-relay on loopback at an emulated RTT and a tail process behind it; ``head_link`` is
the head's sealed link to that tail. ``DEVICE`` is where checkpoints are generated and the tail
runs ("cuda" unless a script sets it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
TINY_TARGET = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
TINY_DRAFT = dict(TINY_TARGET, num_hidden_layers=2, tie_word_embeddings=True)
TOKEN = "bench-token"
SECRET = "bench-session-secret"  # relay runs are end-to-end encrypted, as relay mode is by default
DEVICE = "cuda"


def write_checkpoint(path: Path, shape: dict, seed: int, layers_per_shard: int = 4, follows: int = 0) -> None:
    """A random bf16 Qwen2 checkpoint (sharded safetensors + index), generated on the GPU.

    With ``follows`` (a vocabulary size V), one whose greedy next token is a fixed permutation of
    the current one (the same permutation for every checkpoint written so, whatever its shape): the
    layers' output projections are zero, so the residual stream is the token's embedding, and
    lm_head's row pi(t) is token t's embedding (untied). Two such checkpoints agree on every token
    below V by wide margins; the compute is a random checkpoint's."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, **shape)
    cfg.save_pretrained(path)
    with torch.device("meta"):
        names = {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    perm = torch.randperm(follows, generator=torch.Generator().manual_seed(1234)) if follows else None
    for name, shape_ in names.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        shard = f"layers-{int(m.group(1)) // layers_per_shard:02d}" if m else "outer"
        if name.endswith("norm.weight"):
            t = torch.ones(shape_, dtype=torch.bfloat16)
        elif follows and name.endswith(("o_proj.weight", "down_proj.weight")):
            t = torch.zeros(shape_, dtype=torch.bfloat16)
        elif follows and name == "lm_head.weight":
            t = torch.zeros(shape_, dtype=torch.bfloat16)
            t[perm] = shards["outer"]["model.embed_tokens.weight"][:follows]
        else:
            t = (torch.randn(shape_, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16).cpu()
        shards.setdefault(shard, {})[name] = t
    weight_map = {}
    for shard, tensors in shards.items():
        fname = f"model-{shard}.safetensors"
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))



@contextlib.contextmanager
def relay_and_tail(rtt_ms: int, models_dir: Path, session: str = "bench", mbps: float = 0.0,
                   tail_args: tuple[str, ...] = (), tail_log: Path | None = None):
    """A real sfchat-relay on loopback emulating ``rtt_ms`` (and a link of ``mbps`` each way, 0:
    unlimited) and a tail process on the GPU that may load the checkpoints under ``models_dir``,
    with ``tail_args`` besides, its output written to ``tail_log`` (else dropped): the URL."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    relay = subprocess.Popen([sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0",
                              "--token", TOKEN, "--emulate-rtt-ms", str(rtt_ms), "--emulate-mbps", str(mbps)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    url = None
    while url is None:
        line = relay.stdout.readline()
        if not line:  # it exited before listening (a missing package, a port in use)
            raise RuntimeError(f"sfchat-relay exited with {relay.wait()} before it listened")
        m = re.search(r"listening on ws://[^:]+:(\d+)", line)
        url = f"ws://127.0.0.1:{m.group(1)}" if m else None
    with open(tail_log, "w") if tail_log is not None else contextlib.nullcontext(subprocess.DEVNULL) as out:
        tail = subprocess.Popen([sys.executable, "-m", "sfchat.cli", "--tail", "--relay", url, "--token", TOKEN,
                                 "--secret", SECRET, "--session", session, "--device", DEVICE,
                                 "--models-dir", str(models_dir), *tail_args], env=env,
                                stdout=subprocess.DEVNULL, stderr=out)
        try:
            yield url
        finally:
            tail.terminate()
            relay.terminate()
            tail.wait(30)
            relay.wait(30)


def head_link(url: str, session: str = "bench"):
    """The head's sealed link to the tail behind ``url``, once the tail is there."""
    from sfchat.link.relay import RelayLink
    from sfchat.link.secure import secure

    link = RelayLink(url, TOKEN, session, "head")
    link.wait_peer(120)
    return secure(link, SECRET, session, "head")
