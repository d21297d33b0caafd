"""Hostile clients against a real ``sfchat-relay`` on loopback (issue 13 items 4-5, issue 25 item 3).

    python bench/relay_hostile.py slow [--sessions 12] [--budgets 128] [--frame-mb 12] [--frames 8]
    python bench/relay_hostile.py partial [--holders 40] [--budgets 64,128,256] [--frame-mb 12]
    python bench/relay_hostile.py flood [--seconds 30] [--connections 1100] [--addresses 1,20]
    add --relay-src DIR to run another checkout's relay (e.g. an export of an older commit)

``slow``: ``--sessions`` pairs (each from its own loopback address) whose tails never read while
their heads send ``--frames`` frames of ``--frame-mb`` MiB each as fast as the relay takes them;
prints the relay's RSS at rest, its peak (VmHWM), the peak above rest against the bound the
README promises (``--max-buffer-mb`` + 2 frames + ``SLACK_MIB``) and the RSS once all left, for each
``--max-buffer-mb``.

``partial``: token holders each send the first half of one 12 MiB frame (``--frame-mb``; the
relay runs with its default --max-frame-mb) and then nothing, while
an honest pair keeps doing rounds (a 65 KB FORWARD, a 64-byte VERDICT); prints the relay's RSS at
rest, its peak (VmHWM) and its RSS once the holders left, for each ``--max-buffer-mb``.

``flood``: the relay runs under ``ulimit -n 1024``; idle TCP connections from 127.0.0.2.. (one
address, or several) are held and reopened as soon as the relay drops them, while the honest
pair chats and a new honest client joins every half second; prints the relay's log size, the
``socket.accept() out of system resource`` lines in it, honest rounds and joins.

Every attack is bounded in connections and seconds and stops by itself. The attack clients are
the tests' (tests/relay/test_relay_memory.py, tests/relay/test_relay_flood.py).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "relay")]

from relay_process import REPO, start_relay, status_kib  # noqa: E402
from test_relay_flood import honest, idle_tcp  # noqa: E402
from test_relay_memory import SLACK_MIB, dial, end_wave, half_frames, slow_readers  # noqa: E402

MiB = 1 << 20


def slow(args) -> None:
    print(f"{args.sessions} sessions whose tails never read, each head sending {args.frames} frames of "
          f"{args.frame_mb} MiB; relay from {args.relay_src}\n")
    print("| --max-buffer-mb | sessions | RSS at rest | peak (VmHWM) | peak - rest | bound | within | RSS after | "
          "frames taken |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | :---: | ---: | ---: |")
    for budget in args.budgets:
        with open("/dev/null", "w") as log:
            relay, port = start_relay(log, "--max-buffer-mb", str(budget), "--max-frame-mb", str(args.frame_mb),
                                      cwd=args.relay_src)
        try:
            time.sleep(0.5)
            rest = status_kib(relay.pid, "VmRSS") / 1024
            sent = asyncio.run(asyncio.wait_for(
                slow_readers(port, args.sessions, args.frame_mb * MiB, args.frames), 120))
            time.sleep(1.5)
            peak, after = status_kib(relay.pid, "VmHWM") / 1024, status_kib(relay.pid, "VmRSS") / 1024
        finally:
            relay.terminate()
            relay.wait(10)
        bound = budget + 2 * args.frame_mb + SLACK_MIB
        print(f"| {budget} | {args.sessions} | {rest:.0f} MiB | {peak:.0f} MiB | {peak - rest:.0f} MiB | {bound} MiB | "
              f"{'yes' if peak - rest <= bound else '**no**'} | {after:.0f} MiB | {sum(sent)} |")


async def partial_round(port: int, holders: int, frame_mb: int) -> tuple[int, int, int]:
    head, tail = await dial(port, "honest", "head"), await dial(port, "honest", "tail")
    rounds, failures = 0, 0
    stop = asyncio.Event()

    async def chat():
        nonlocal rounds, failures
        while not stop.is_set():
            try:
                await head.send(b"F" * 65_000)
                while isinstance(await asyncio.wait_for(tail.recv(), 20), str):
                    pass
                await tail.send(b"V" * 64)
                while isinstance(await asyncio.wait_for(head.recv(), 20), str):
                    pass
                rounds += 1
            except Exception:  # noqa: BLE001 - counted and reported
                failures += 1
                return

    chatting = asyncio.create_task(chat())
    held = await half_frames(port, holders, frame_mb * MiB, 0)
    await asyncio.sleep(2.0)
    cut = await end_wave(held, stop, chatting)
    await head.close()
    await tail.close()
    return rounds, failures, cut


def partial(args) -> None:
    print(f"{args.holders} token holders x half of a {args.frame_mb} MiB frame ({args.holders * args.frame_mb // 2} "
          f"MiB offered), relay from "
          f"{args.relay_src}\n")
    print("| --max-buffer-mb | RSS at rest | peak (VmHWM) | peak - rest | RSS after | holders cut | honest rounds |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for budget in args.budgets:
        with open("/dev/null", "w") as log:
            relay, port = start_relay(log, "--max-buffer-mb", str(budget), cwd=args.relay_src)
        try:
            time.sleep(0.5)
            rest = status_kib(relay.pid, "VmRSS") / 1024
            rounds, failures, cut = asyncio.run(asyncio.wait_for(partial_round(port, args.holders, args.frame_mb), 120))
            time.sleep(1.5)
            peak, after = status_kib(relay.pid, "VmHWM") / 1024, status_kib(relay.pid, "VmRSS") / 1024
        finally:
            relay.terminate()
            relay.wait(10)
        print(f"| {budget} | {rest:.0f} MiB | {peak:.0f} MiB | {peak - rest:.0f} MiB | {after:.0f} MiB | "
              f"{cut}/{args.holders} | {rounds}{f' ({failures} failed)' if failures else ''} |")


def lower_fd_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


async def flood_round(port: int, connections: int, addresses: int, seconds: float):
    deadline = time.monotonic() + seconds
    opened = [0]
    attack = [asyncio.create_task(idle_tcp(port, f"127.0.0.{2 + i % addresses}", deadline, opened))
              for i in range(connections)]
    await asyncio.sleep(1.0)
    try:
        rounds, probes, failures = await honest(port, deadline)
    except Exception as exc:  # noqa: BLE001 - the honest pair itself failed: reported
        rounds, probes, failures = 0, 0, [f"honest pair: {type(exc).__name__}"]
    await asyncio.gather(*attack)
    return rounds, probes, failures, opened[0]


def flood(args, tmp: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.connections + 512)), hard))
    print(f"{args.seconds:g} s of idle TCP connections ({args.connections} held at once), relay under "
          f"ulimit -n 1024 with --max-connections 32, relay from {args.relay_src}\n")
    print("| addresses | connections opened | log bytes | 'out of system resource' | honest rounds | "
          "new clients joined | relay alive |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | :---: |")
    for addresses in args.addresses:
        log_path = tmp / f"relay-flood-{addresses}.log"
        with open(log_path, "w") as log:
            relay, port = start_relay(log, "--max-connections", "32", preexec=lower_fd_limit, cwd=args.relay_src)
        try:
            rounds, probes, failures, opened = asyncio.run(asyncio.wait_for(
                flood_round(port, args.connections, addresses, args.seconds), args.seconds + 90))
            alive = relay.poll() is None
        finally:
            relay.terminate()
            relay.wait(10)
        text = log_path.read_text(errors="replace")
        print(f"| {addresses} | {opened} | {len(text.encode())} | {text.count('out of system resource')} | "
              f"{rounds} | {probes - len(failures)}/{probes} | {'yes' if alive else 'no'} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=["slow", "partial", "flood"])
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--holders", type=int, default=40)
    p.add_argument("--frame-mb", type=int, default=12)
    p.add_argument("--budgets", type=lambda t: [int(x) for x in t.split(",")], default=None,
                   help="--max-buffer-mb values (default 128 for slow, 64,128,256 for partial)")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--connections", type=int, default=1100)
    p.add_argument("--addresses", type=lambda t: [int(x) for x in t.split(",")], default=[1, 20])
    p.add_argument("--relay-src", type=Path, default=REPO)
    args = p.parse_args()
    if args.budgets is None:
        args.budgets = [128] if args.scenario == "slow" else [64, 128, 256]
    if args.scenario == "slow":
        slow(args)
    elif args.scenario == "partial":
        partial(args)
    else:
        tmp = Path("/tmp") / f"sfchat-relay-bench-{time.time_ns()}"
        tmp.mkdir()
        flood(args, tmp)


if __name__ == "__main__":
    main()
