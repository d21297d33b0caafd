"""How often the pipeline policy's choice of schedule flips between two runs, from noise alone.

Why: two runs of ``auto`` on one GPU, over the same prompts, followed different schedules (issue
48: round for 91 % of the verdicts in one run, stream for 99 % in the next). The policy
(``sfchat.engine.policy.PipelinePolicy``, the product's own, torch-free) is fed verdicts here on a
virtual clock: each schedule has a true rate, and each verdict draws what the tree expected the frame
to commit and the ms since the verdict before from seeded noise (the CVs below, as a plausible
spread, not measured ones), and commits that plus noise (the policy counts the tokens committed). Nothing else runs: no models, no link. The figures are SIMULATED: what the
decision rule does with noise of that size, never a measurement of a run.

Per RTT and per ratio of the schedules' true rates (stream's over round's), over ``--runs`` seeded
runs of ``--ms`` of decoding each: the share of run pairs that spent most of their time under
different schedules, the share of runs that spent most of it under the slower one, and the tokens committed against the faster schedule
followed all the time (the trials and the switches included); ``--trials`` tries other lengths of
a trial (``MIN-MAX:VERDICTS``: ``TRIAL_TRIPS`` trips within MIN and MAX ms, or ``MS:VERDICTS``; the product's first); ``--rules`` other decision rules
(``CONFIDENCE:MAX_TRIALS:UNSURE_MS``, the product's first; ``0:2:0`` is the rule before them: the
better mean after one trial of each); ``--burst RHO`` makes streamed verdicts correlated, each with
the one before (frames in flight do that), where the policy's standard error assumes them independent.

    python3 bench/policy_flips.py [--runs 200] [--ms 30000,6000] [--rtts 86,175] [--trials 1000:12,4000:48]
                                  [--rules 2:6:4000,0:2:0] [--burst 0.6]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sfchat.engine import policy as pol  # noqa: E402
from sfchat.engine.policy import PipelinePolicy  # noqa: E402

# per schedule at an RTT: tokens the tree expects a verdict to commit, and the ms between verdicts
# (round: a frame per round trip; stream: frames in flight); the CVs of each, verdict to verdict
ROUND_TOKENS, STREAM_TOKENS = 5.5, 1.9
CV = {"round": (0.35, 0.05), "stream": (0.5, 0.3)}
BUILD_MS, TAIL_MS = 12.0, 8.0


def positive(rng: random.Random, mean: float, cv: float) -> float:
    """A draw around ``mean`` with coefficient of variation ``cv`` (a gamma: never below 0)."""
    shape = 1.0 / (cv * cv)
    return rng.gammavariate(shape, mean / shape)


def correlated(rng: random.Random, state: list[float], i: int, mean: float, cv: float, rho: float) -> float:
    """A lognormal draw around ``mean`` with coefficient of variation ``cv`` whose log is ``state[i]``,
    an AR(1) process with coefficient ``rho`` (stepped here)."""
    state[i] = rho * state[i] + math.sqrt(1 - rho * rho) * rng.gauss(0.0, 1.0)
    sigma = math.sqrt(math.log(1 + cv * cv))
    return mean * math.exp(sigma * state[i] - sigma * sigma / 2)


def one_run(seed: int, rtt: float, ratio: float, ms: float, burst: float = 0.0) -> tuple[str, float]:
    """A run of ``ms`` virtual ms: the schedule it spent the most time under, and the tokens committed.
    ``burst`` > 0: a streamed verdict's ms and tokens are correlated with the verdict's before it
    (each a lognormal draw whose log follows an AR(1) process with that coefficient), as frames in
    flight make them; 0: independent gamma draws."""
    rng = random.Random(seed)
    state = [0.0, 0.0]  # the AR(1) processes of a streamed verdict's tokens and ms
    round_ms = rtt + BUILD_MS + TAIL_MS
    means = {"round": (ROUND_TOKENS, round_ms),
             "stream": (STREAM_TOKENS, STREAM_TOKENS / (ratio * ROUND_TOKENS / round_ms))}
    policy = PipelinePolicy(8)
    clock = tokens = 0.0
    spent = {"round": 0.0, "stream": 0.0}
    while clock < ms:
        name = policy.schedule().name
        (t_mean, ms_mean), (t_cv, ms_cv) = means[name], CV[name]
        if burst > 0 and name == "stream":
            expected, took = (correlated(rng, state, i, mean, cv, burst)
                              for i, mean, cv in ((0, t_mean, t_cv), (1, ms_mean, ms_cv)))
        else:
            expected, took = positive(rng, t_mean, t_cv), positive(rng, ms_mean, ms_cv)
        committed = max(0, round(expected + rng.gauss(0.0, 1.0)))
        policy.observe(tokens=committed, sent_bytes=20_000, rtt_ms=rtt, tail_ms=TAIL_MS, build_ms=BUILD_MS,
                       round_ms=took, schedule=name)
        clock += took
        tokens += committed
        spent[name] += took
    return max(spent, key=spent.get), tokens


def trial_length(text: str) -> tuple[float, float, int]:
    """``MIN-MAX:VERDICTS`` or ``MS:VERDICTS`` (MIN = MAX = MS) as (TRIAL_MIN_MS, TRIAL_MS, TRIAL_VERDICTS)."""
    span, _, verdicts = text.partition(":")
    low, _, high = span.partition("-")
    return float(low), float(high or low), int(verdicts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--ms", default="30000,6000", help="virtual ms of decoding per run (a session, a short reply)")
    ap.add_argument("--rtts", default="86,175")
    ap.add_argument("--ratios", default="0.8,0.9,0.95,1.0,1.05,1.1,1.25")
    ap.add_argument("--trials", default=f"{pol.TRIAL_MIN_MS:.0f}-{pol.TRIAL_MS:.0f}:{pol.TRIAL_VERDICTS}",
                    help="trial lengths to try, comma-separated: MIN-MAX:VERDICTS (a trial of TRIAL_TRIPS "
                         "frame trips within MIN and MAX ms, and VERDICTS), or MS:VERDICTS (MS whatever the trip)")
    ap.add_argument("--rules", default=f"{pol.CONFIDENCE:g}:{pol.MAX_TRIALS}:{pol.UNSURE_MS:.0f}",
                    help="decision rules to try, CONFIDENCE:MAX_TRIALS:UNSURE_MS, comma-separated")
    ap.add_argument("--burst", type=float, default=0.0,
                    help="streamed verdicts correlated with the one before, AR(1) coefficient (0: independent)")
    args = ap.parse_args()
    print("SIMULATED (bench/policy_flips.py): the product's policy fed seeded noisy verdicts; "
          f"CVs {CV}, streamed verdicts' AR(1) coefficient {args.burst:g}, {args.runs} runs per row\n")
    print("| rule: confidence, trials, unsure ms | trial: ms, verdicts | decoding ms | RTT ms | stream / round, "
          "true rate | two runs mostly under different schedules | runs mostly under the slower | tokens vs the "
          "faster followed all along |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    trials = [trial_length(t) for t in args.trials.split(",")]
    rules = [(float(r.split(":")[0]), int(r.split(":")[1]), float(r.split(":")[2])) for r in args.rules.split(",")]
    for (pol.CONFIDENCE, pol.MAX_TRIALS, pol.UNSURE_MS), (pol.TRIAL_MIN_MS, pol.TRIAL_MS, pol.TRIAL_VERDICTS), ms in (
            (r, t, float(x)) for r in rules for t in trials for x in args.ms.split(",")):
        for rtt in (float(x) for x in args.rtts.split(",")):
            round_rate = ROUND_TOKENS / (rtt + BUILD_MS + TAIL_MS)
            for ratio in (float(x) for x in args.ratios.split(",")):
                ends = [one_run(seed, rtt, ratio, ms, args.burst) for seed in range(args.runs)]
                pairs = list(zip(ends[0::2], ends[1::2]))
                differ = sum(a[0] != b[0] for a, b in pairs) / len(pairs)
                slower = "round" if ratio > 1 else "stream" if ratio < 1 else None
                on_slower = sum(e[0] == slower for e in ends) / len(ends) if slower else float("nan")
                best = max(round_rate, ratio * round_rate) * ms
                share = sum(e[1] for e in ends) / len(ends) / best
                rule = f"{pol.CONFIDENCE:g}, {pol.MAX_TRIALS}, {pol.UNSURE_MS:.0f}"
                trial = f"{pol.TRIAL_MS:.0f}" if pol.TRIAL_MIN_MS >= pol.TRIAL_MS else \
                    f"{pol.TRIAL_TRIPS} trips in {pol.TRIAL_MIN_MS:.0f}-{pol.TRIAL_MS:.0f}"
                print(f"| {rule} | {trial}, {pol.TRIAL_VERDICTS} | {ms:.0f} | {rtt:.0f} | {ratio:.2f} | "
                      f"{differ:.0%} | "
                      f"{'-' if slower is None else f'{on_slower:.0%}'} | {share:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
