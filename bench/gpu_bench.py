"""GPU benchmark: eager vs CUDA-graphed figures at the shapes of Qwen2.5-7B (target) and 0.5B (draft).

Writes random-weight bf16 checkpoints with those shapes to a scratch directory (no hub access
needed), then measures on one GPU and prints one table:

  draft ms per round (K), head and tail verify ms (K+1 tokens), round ms in local mode,
  round ms through a real sfchat-relay on loopback at two emulated RTTs, tok/s with
  draft = target, and tok/s derived at 4.07 tokens per round.

Run from the repository root:  python3 bench/gpu_bench.py [--k 8] [--rounds 48] [--out results.json]
Needs a CUDA GPU, torch, transformers, safetensors, websockets and platformdirs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sfchat.config import Settings  # noqa: E402
from sfchat.engine import sampling  # noqa: E402
from sfchat.node.loading import open_engine  # noqa: E402
from sfchat.protocol.wire import Sampling  # noqa: E402

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
TINY_TARGET = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
TINY_DRAFT = dict(TINY_TARGET, num_hidden_layers=2, tie_word_embeddings=True)
TOKEN = "bench-token"
SECRET = "bench-session-secret"  # relay rows run end-to-end encrypted, as relay mode does by default
DEVICE = "cuda"
GREEDY = Sampling()


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


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cuda_ms(fn, n: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) * 1e3 / n


# column -> (CUDA graphs, torch.compile of the draft)
VARIANTS = {"eager": (False, False), "graphed": (True, False), "compiled": (True, True)}


def settings(target: Path, draft, k: int, variant: str) -> Settings:
    graphs, compiled = VARIANTS[variant]
    return Settings(model=str(target), draft=str(draft), k=k, device=DEVICE, cuda_graphs=graphs,
                    compile_draft=compiled, max_context=2048)


def component_figures(target: Path, draft: Path, k: int, variant: str, n: int) -> dict:
    """Draft, head-verify and tail-verify times of one engine, for one variant."""
    t0 = time.perf_counter()
    engine, _ = open_engine(settings(target, draft, k, variant))
    load_s = time.perf_counter() - t0
    head, drafter, tail = engine.head, engine.drafter, engine.link.verifier.model
    prompt = list(range(100, 228))
    engine.begin(prompt)
    engine.round(GREEDY, set(), 10 ** 6)  # prefill + one round: steady state from here
    tokens = list(engine.tokens)

    def draft_round():
        drafts, _, _ = drafter.propose(tokens, GREEDY, None)
        tokens.append(drafts[0])  # one committed token per round: the next feed is 2 tokens

    out = {"draft_ms": cuda_ms(draft_round, n), "load_s": load_s}
    p = len(tokens)
    ids = torch.tensor(tokens[-(k + 1):], device=DEVICE)
    pos = torch.arange(p, p + k + 1, device=DEVICE)
    end = p + k + 1  # the engine's forwards attend over the window that holds the context
    out["head_ms"] = cuda_ms(lambda: head.run(ids, pos, end=end), n)
    hidden = head.run(ids, pos, end=end).clone()
    drafts = ids[1:]
    out["tail_ms"] = cuda_ms(lambda: sampling.verify(tail.run(hidden, pos, k + 1, end=end), drafts, GREEDY,
                                                     torch.empty(k, 0), torch.empty(k, 0), None), n)
    out["round_ms"], out["tokens_per_round"] = run_rounds(engine, n)
    engine.link.close()
    return out


def run_rounds(engine, n: int) -> tuple[float, float]:
    engine.begin(list(range(200, 328)))
    engine.round(GREEDY, set(), 10 ** 6)
    rounds = [engine.round(GREEDY, set(), 10 ** 6) for _ in range(n)]
    return (statistics.mean(r.stats.round_ms for r in rounds),
            statistics.mean(len(r.tokens) for r in rounds))


@contextlib.contextmanager
def relay_and_tail(rtt_ms: int, models_dir: Path, session: str = "bench"):
    """A real sfchat-relay on loopback emulating ``rtt_ms`` and a tail process on the GPU that may
    load the checkpoints under ``models_dir``: the URL."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    relay = subprocess.Popen([sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0",
                              "--token", TOKEN, "--emulate-rtt-ms", str(rtt_ms)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    url = None
    while url is None:
        m = re.search(r"listening on ws://[^:]+:(\d+)", relay.stdout.readline())
        url = f"ws://127.0.0.1:{m.group(1)}" if m else None
    tail = subprocess.Popen([sys.executable, "-m", "sfchat.cli", "--tail", "--relay", url, "--token", TOKEN,
                             "--secret", SECRET, "--session", session, "--device", DEVICE,
                             "--models-dir", str(models_dir)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def engine_facing(s: Settings, url: str, session: str, engine=None):
    """A head engine for ``s`` talking to the tail behind ``url``: built on the first call; on
    later calls the same loaded head, re-pointed at this tail (fresh hello, context re-sent)."""
    link = head_link(url, session)
    if engine is None:
        return open_engine(s, link=link)[0]
    engine.link.close()
    engine.link = link
    engine.connect(engine.hello)
    engine.rounds.forget_tail()
    return engine


def relay_figures(target: Path, draft: Path, k: int, rtt_ms: int, n: int, variants) -> dict:
    """Round ms per variant through sfchat-relay on loopback with a tail process on the GPU."""
    out = {}
    with relay_and_tail(rtt_ms, target.parent) as url:
        for variant in variants:
            link = head_link(url)
            engine, _ = open_engine(settings(target, draft, k, variant), link=link)
            rounds_ms, _ = run_rounds(engine, n)
            out[variant] = rounds_ms
            link.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=48)
    ap.add_argument("--rtt", type=int, nargs="*", default=[0, 86])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS),
                    help="columns to measure (default: all)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a quick check of the script")
    args = ap.parse_args()
    global DEVICE
    target_shape, draft_shape = QWEN25_7B, QWEN25_05B
    if args.tiny:
        DEVICE, target_shape, draft_shape = "cpu", TINY_TARGET, TINY_DRAFT
    k, n = args.k, args.rounds
    root = Path(tempfile.mkdtemp(prefix="sfchat-bench-"))
    t0 = time.perf_counter()
    write_checkpoint(root / "target", target_shape, seed=1)
    write_checkpoint(root / "draft", draft_shape, seed=2)
    print(f"checkpoints written in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (tiny shapes)"
    res = {"device": name, "torch": torch.__version__, "k": k}

    def save():  # after every stage, so a run cut short still leaves its figures
        if args.out:
            args.out.write_text(json.dumps(res, indent=1))

    for variant in args.variants:
        res[variant] = component_figures(root / "target", root / "draft", k, variant, n)
        print(f"components ({variant}) done", file=sys.stderr, flush=True)
        save()
    for variant in [v for v in ("compiled",) if v in args.variants]:  # draft = target: all accepted
        engine, _ = open_engine(settings(root / "target", root / "target", k, variant))
        ms, tpr = run_rounds(engine, max(n // 4, 8))
        res[variant].update(self_round_ms=ms, self_tokens_per_round=tpr)
        del engine
        save()
    for rtt in args.rtt:
        for variant, ms in relay_figures(root / "target", root / "draft", k, rtt, n,
                                           [v for v in ("eager", "compiled", "graphed") if v in args.variants][:2]).items():
            res[variant][f"relay{rtt}_ms"] = ms
        print(f"relay at {rtt} ms done", file=sys.stderr, flush=True)
        save()
    print_table(res, k, args.rtt)


def print_table(res: dict, k: int, rtts: list[int]) -> None:
    def cell(variant, key, fmt="{:.2f}", scale=None):
        value = res.get(variant, {}).get(key)
        if value is None:
            return "-"
        return fmt.format(scale(value, res[variant]) if scale else value)

    rows = [(f"draft ms per round (K={k})", "draft_ms"), (f"head verify ms ({k + 1} tokens)", "head_ms"),
            (f"tail verify ms ({k + 1} tokens)", "tail_ms"), ("round ms, local mode", "round_ms")]
    rows += [(f"round ms, relay at {r} ms emulated RTT", f"relay{r}_ms") for r in rtts]
    print(f"\n{res['device']}, torch {res['torch']}, bf16, Qwen2.5-7B / 0.5B shapes, random weights, K={k}\n")
    print("| figure | eager | graphed | graphed + compiled draft |\n| --- | --- | --- | --- |")
    for label, key in rows:
        print(f"| {label} | " + " | ".join(cell(v, key) for v in VARIANTS) + " |")
    print("| tok/s, draft = target (tokens per round) | " + " | ".join(
        cell(v, "self_round_ms", "{}", lambda ms, r: f"{1e3 * r['self_tokens_per_round'] / ms:.1f} "
                                                    f"({r['self_tokens_per_round']:.2f})") for v in VARIANTS) + " |")
    for key, label in [("round_ms", "local")] + [(f"relay{r}_ms", f"relay {r} ms") for r in rtts]:
        print(f"| tok/s derived at 4.07 tokens/round, {label} | " + " | ".join(
            cell(v, key, "{:.1f}", lambda ms, r: 4070 / ms) for v in VARIANTS) + " |")
    print("| engine load + capture s | " + " | ".join(cell(v, "load_s", "{:.0f}") for v in VARIANTS) + " |")


if __name__ == "__main__":
    main()
