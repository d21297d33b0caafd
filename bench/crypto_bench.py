"""Cost of end-to-end encryption per speculative round (CPU only, no torch): seal + open of real frames.

A round of Qwen2.5-7B with K=8 is one FORWARD head -> tail (9 tokens x 3584 hidden, bf16: ~64 KB)
and one VERDICT back. Both nodes pay their half: the head seals the FORWARD and opens the
VERDICT, the tail the reverse. The table gives the median of many repetitions in microseconds,
with the plain wire encode + decode beside it for scale, a 512-token prefill chunk, and the
one-time costs (scrypt of the secret, pairing).

    python3 bench/crypto_bench.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sfchat.link import secure as secure_link  # noqa: E402
from sfchat.protocol import wire  # noqa: E402
from sfchat.link.secure import SecureLink  # noqa: E402

HIDDEN, K = 3584, 8  # Qwen2.5-7B


class Loopback:
    """Two ends of an in-memory link, so that only sealing and opening are timed."""

    def __init__(self):
        self.queues = {"head": deque(), "tail": deque()}

    def end(self, role: str):
        loop, other = self, "tail" if role == "head" else "head"

        class End:
            peer_present = True

            def send(self, frame):
                loop.queues[other].append(bytes(frame))

            def recv(self, timeout=None):
                if not loop.queues[role]:
                    raise TimeoutError("empty")
                return loop.queues[role].popleft()

            def close(self):
                pass

        return End()


def forward(n_tokens: int, n_draft: int) -> bytes:
    return wire.encode(wire.Forward(
        round=7, start_pos=1000, tokens=tuple(range(100, 100 + n_tokens)), hidden=os.urandom(n_tokens * HIDDEN * 2),
        dtype=wire.DType.BFLOAT16, hidden_size=HIDDEN, n_draft=n_draft, want_verdict=n_draft > 0))


def median_us(fn, n: int) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    n = ap.parse_args().rounds

    t0 = time.perf_counter()
    secure_link._master.cache_clear()
    secure_link._master("bench secret for sfchat", "bench")
    scrypt_ms = (time.perf_counter() - t0) * 1e3
    loop = Loopback()
    t0 = time.perf_counter()
    head = SecureLink(loop.end("head"), "bench secret for sfchat", "bench", "head")
    tail = SecureLink(loop.end("tail"), "bench secret for sfchat", "bench", "tail")
    head.handshake(1)
    tail.handshake(1)
    pairing_ms = (time.perf_counter() - t0) * 1e3

    fwd = forward(K + 1, K)
    verdict = wire.encode(wire.Verdict(7, 1000, 5, tuple(range(6)), 1234))
    chunk = forward(512, 0)

    def through(sender, receiver, frame):
        return lambda: (sender.send(frame), receiver.recv())

    rows = []
    for name, frame, sender, receiver in (("FORWARD, 9 tokens (head -> tail)", fwd, head, tail),
                                          ("VERDICT, 6 tokens (tail -> head)", verdict, tail, head),
                                          ("prefill chunk, 512 tokens", chunk, head, tail)):
        reps = n if len(frame) < 1 << 20 else max(n // 20, 20)
        sealed = median_us(through(sender, receiver, frame), reps)
        plain = median_us(lambda: wire.decode(frame), reps)
        rows.append((name, len(frame), sealed, plain))

    print(f"sfchat end-to-end encryption cost ({platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, {n} repetitions, medians)")
    print()
    print("| frame | plaintext bytes | seal + open µs | wire decode µs (for scale) |")
    print("| --- | --- | --- | --- |")
    for name, size, sealed, plain in rows:
        print(f"| {name} | {size:,} | {sealed:.1f} | {plain:.1f} |")
    per_round = rows[0][2] + rows[1][2]
    print(f"| **per round (FORWARD + VERDICT)** | {rows[0][1] + rows[1][1]:,} | **{per_round:.1f}** | "
          f"{rows[0][3] + rows[1][3]:.1f} |")
    print()
    print(f"one-time: scrypt of the secret {scrypt_ms:.0f} ms (cached per process), pairing "
          f"(key exchange + HKDF) {pairing_ms:.1f} ms; {secure_link.OVERHEAD} bytes added per frame")


if __name__ == "__main__":
    main()
