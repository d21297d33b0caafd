"""The pipeline policy, without models: its schedules and frames in flight from measured verdicts."""

from __future__ import annotations

import math

import pytest

from sfchat.engine import policy as pol
from sfchat.engine.policy import ROUND, STREAM, PipelinePolicy


def feed(policy, n=30, tokens=4, sent_bytes=20_000, rtt_ms=86.0, tail_ms=10.0, build_ms=8.0, overhead_ms=1.0,
         round_ms=None, schedule=None):
    for _ in range(n):
        policy.observe(tokens=tokens, sent_bytes=sent_bytes, rtt_ms=rtt_ms, tail_ms=tail_ms, build_ms=build_ms,
                       overhead_ms=overhead_ms, round_ms=round_ms, schedule=schedule)


def streaming(max_in_flight: int) -> PipelinePolicy:
    return PipelinePolicy(max_in_flight, schedules=(STREAM,))


def test_one_frame_until_a_steady_frame_was_measured():
    policy = streaming(4)
    assert policy.choose() == 1
    feed(policy, n=1, build_ms=None)  # a first frame carries the prefill: not a steady frame's cost
    assert policy.choose() == 1
    feed(policy, n=1)
    assert policy.choose() > 1


def test_a_long_round_trip_fills_the_pipeline_and_a_short_one_does_not():
    far = streaming(8)
    feed(far, rtt_ms=86.0, tail_ms=10.0, build_ms=8.0)
    assert far.choose() == 8  # (8 + 1 + 86 + 10) / 10 ms: the tail is the slowest stage, ~10 frames wanted
    near = streaming(8)
    feed(near, rtt_ms=0.5, tail_ms=10.0, build_ms=8.0)
    assert near.choose() == 2  # the head and the tail each busy about half the round trip
    alone = PipelinePolicy(max_in_flight=1)  # local mode
    feed(alone)
    assert alone.choose() == 1 and alone.schedules == (ROUND,)


def test_the_link_is_fitted_as_latency_plus_bytes():
    policy = streaming(4)
    for i in range(60):  # frames of two byte counts (a prefill, a tree) through a link of 50 ms + 0.1 ms/KB
        sent = 10_000 if i % 2 == 0 else 90_000
        policy.observe(tokens=3, sent_bytes=sent, rtt_ms=50.0 + sent * 1e-4, tail_ms=5.0, build_ms=5.0)
    assert abs(policy.base_ms - 50.0) < 1.0 and abs(policy.ms_per_byte - 1e-4) < 1e-5
    total, stage = policy.timing()
    assert stage == max(5.0, policy.bytes * policy.ms_per_byte) and total > 50.0 + 5.0 + 5.0


def run(policy, rates: dict[str, tuple[float, float]], verdicts: int) -> list[str]:
    """Verdicts of the schedule the policy follows, each committing and taking what ``rates`` says
    for it: the schedules followed, verdict by verdict."""
    seen = []
    for _ in range(verdicts):
        name = policy.schedule().name
        tokens, ms = rates[name]
        policy.observe(tokens=tokens, sent_bytes=20_000, rtt_ms=86.0, tail_ms=8.0, build_ms=10.0,
                       round_ms=ms, schedule=name)
        seen.append(name)
    return seen


@pytest.mark.parametrize("faster", ["round", "stream"])
def test_each_schedule_is_measured_then_the_faster_one_is_followed(faster):
    policy = PipelinePolicy(8)
    assert policy.schedule() is STREAM and policy.choose() == 1  # stream first, one frame until one was measured
    # round: 5 tokens per 120 ms; stream: 1 token per 30 ms (0.033 per ms) or per 15 ms (0.067)
    rates = {"round": (5.0, 120.0), "stream": (1.0, 30.0 if faster == "round" else 15.0)}
    seen = run(policy, rates, 200)  # the two trials, then the time it follows the faster (REVISIT_MS)
    assert {"round", "stream"} <= set(seen)  # both were tried
    assert policy.measured["round"].rate() == pytest.approx(5 / 120)
    assert policy.measured["stream"].rate() == pytest.approx(rates["stream"][0] / rates["stream"][1])
    assert policy.schedule().name == faster
    # what it chose, and on what: stream's trial, round's, then the faster followed
    chosen = [(d.chosen, d.trial) for d in policy.decisions]
    assert chosen[:2] == [("round", True), (faster, False)]
    last = policy.decisions[1]
    # a lead without noise is clear at once: round's trial ends after TRIAL_MS, short of TRIAL_VERDICTS
    assert last.rates["round"][0] == pytest.approx(5 / 120) and last.rates["round"][1] == math.ceil(pol.TRIAL_MS / 120)
    assert 0 < last.verdict <= policy.verdicts
    if faster == "stream":
        assert policy.schedule().steps == pol.STREAM_STEPS and policy.choose() > 1
    else:
        assert policy.schedule().steps is None and policy.choose() == 1


def test_a_trial_lasts_long_enough_and_the_others_are_measured_again():
    policy = PipelinePolicy(8)
    rates = {"round": (5.0, 100.0), "stream": (1.0, 50.0)}  # round is the faster
    seen = run(policy, rates, 3000)
    first = seen.index("round")  # the verdicts stream was measured on first
    assert first >= pol.SETTLE + max(pol.TRIAL_VERDICTS, pol.TRIAL_MS / 50.0)
    # then round's trial; after both were measured round is followed, and stream is tried again
    # only after REVISIT_MS
    again = seen.index("stream", first)
    assert (again - first) * 100.0 >= pol.REVISIT_MS
    time_in = {name: seen.count(name) * rates[name][1] for name in rates}
    assert time_in["round"] > 0.9 * sum(time_in.values())  # the slower one costs at most a tenth of the time


def test_verdicts_of_frames_built_under_another_schedule_or_carrying_a_prefill_do_not_count():
    policy = PipelinePolicy(8)
    feed(policy, n=50, schedule="round", round_ms=10.0, tokens=9)  # frames of the schedule before: drained
    feed(policy, n=50, schedule="stream", round_ms=10.0, tokens=9, build_ms=None)  # prefill frames
    assert policy.measured["round"].counted == 0 and policy.schedule() is STREAM
    assert policy.measured["stream"].counted == 0


def noisy(policy, rates: dict[str, tuple[tuple[float, float], float]], verdicts: int, block: int = 8) -> None:
    """Verdicts whose committed tokens alternate between the two values ``rates`` gives the schedule
    followed, each taking its ms: verdict by verdict for one frame at a time, in runs of ``block``
    verdicts for frames in flight (whose rate's error comes from batches of a frame's trip, ~100 ms
    here: noise verdict by verdict would cancel within a batch)."""
    for i in range(verdicts):
        name = policy.schedule().name
        pair, ms = rates[name]
        tokens = pair[i % 2 if name == "round" else (i // block) % 2]
        policy.observe(tokens=tokens, sent_bytes=20_000, rtt_ms=86.0, tail_ms=8.0, build_ms=10.0,
                       round_ms=ms, schedule=name)


def test_schedules_within_the_noise_are_compared_over_more_trials_before_one_is_followed():
    policy = PipelinePolicy(8)
    # stream 2 +- 1 tokens per 30 ms (0.067 per ms), round 6 +- 1 per 100 ms (0.060): 10 % apart,
    # within two standard errors of the difference after one trial of each
    noisy(policy, {"stream": ((1, 3), 30.0), "round": ((5, 7), 100.0)}, 2000)
    chosen = [(d.chosen, d.trial, d.sure) for d in policy.decisions]
    # round's trial; stream, the better mean, followed while unsure; round tried again; ... then sure
    sure = chosen.index(("stream", False, True))
    assert chosen[:sure] == [("round", True, False)] + [("stream", False, False), ("round", True, False)] * (sure // 2)
    assert 3 <= sure < 2 * pol.MAX_TRIALS - 2  # more than one trial of each, before the last
    assert policy.decisions[sure].rates["stream"][1] > pol.UNSURE_MS / 30.0  # its verdicts while followed count
    assert policy.decisions[sure].rates["round"][1] >= 2 * pol.TRIAL_VERDICTS


def test_a_long_trial_is_tried_again_only_after_long_enough_that_it_costs_a_tenth_of_the_time():
    policy = PipelinePolicy(8)
    # as above, but round's verdicts take 300 ms (a round trip of ~290 ms): its trial of a dozen
    # verdicts spans 3.6 s, which the 4 s wait of UNSURE_MS alone would repeat every 7.6 s
    noisy(policy, {"stream": ((1, 3), 30.0), "round": ((17, 19), 300.0)}, 4000)
    first, followed, again = policy.decisions[0], policy.decisions[1], policy.decisions[2]
    assert (first.chosen, first.trial) == ("round", True) and (followed.chosen, followed.sure) == ("stream", False)
    assert again.chosen == "round" and again.trial
    # the policy's clock is the ms each verdict was fed with (300 a round one, 30 a stream one)
    trial_verdicts, followed_verdicts = followed.rates["round"][1], again.verdict - followed.verdict
    assert trial_verdicts >= pol.TRIAL_VERDICTS
    trial_share = trial_verdicts * 300.0 / (trial_verdicts * 300.0 + followed_verdicts * 30.0)
    assert trial_share <= pol.RETRIAL_SHARE + 1e-9  # the next trial costs a tenth of the time at most
    assert followed_verdicts * 30.0 > pol.UNSURE_MS  # longer than the 4 s that ruled before


def test_schedules_never_told_apart_are_settled_by_their_means_after_the_last_trial():
    policy = PipelinePolicy(8)
    # stream 0.0667 per ms against round 0.0666: no number of trials tells them apart
    noisy(policy, {"stream": ((1, 3), 30.0), "round": ((5, 8), 97.6)}, 5000)
    chosen = [(d.chosen, d.trial, d.sure) for d in policy.decisions]
    sure = next(i for i, (_, trial, sure) in enumerate(chosen) if sure)
    assert chosen[0] == ("round", True, False) and not any(s for *_, s in chosen[:sure])
    assert sum(trial for _, trial, _ in chosen[:sure]) == pol.MAX_TRIALS - 1  # MAX_TRIALS in all, stream's first
    d = policy.decisions[sure]
    assert d.chosen == max(d.rates, key=lambda k: d.rates[k][0])  # the better mean, however slight


def test_a_lead_beyond_the_noise_is_followed_after_one_trial_of_each():
    policy = PipelinePolicy(8)
    noisy(policy, {"stream": ((2, 4), 30.0), "round": ((5, 7), 100.0)}, 200)  # 0.100 per ms against 0.060
    chosen = [(d.chosen, d.trial, d.sure) for d in policy.decisions]
    assert chosen[:2] == [("round", True, False), ("stream", False, True)]


def test_a_new_comparison_measures_the_other_schedule_afresh():
    policy = PipelinePolicy(8)
    rates = {"round": (5.0, 100.0), "stream": (1.0, 50.0)}
    for _ in range(5000):  # stream's first trial, round's, round followed for REVISIT_MS: then the revisit
        run(policy, rates, 1)
        if len(policy.decisions) == 3:
            break
    assert [(d.chosen, d.trial, d.sure) for d in policy.decisions] == [
        ("round", True, False), ("round", False, True), ("stream", True, False)]
    assert policy.measured["stream"].n == 0  # its first trial's verdicts no longer count
    run(policy, {"round": (5.0, 100.0), "stream": (4.0, 20.0)}, 60)  # the link changed: stream is faster now
    assert policy.decisions[-1].chosen == "stream" and not policy.decisions[-1].trial
    assert policy.decisions[-1].rates["stream"][0] == pytest.approx(4.0 / 20.0)  # the new trial's rate alone


def test_with_one_schedule_it_is_followed_without_trials():
    policy = PipelinePolicy(1)  # local mode: round only
    run(policy, {"round": (5.0, 100.0)}, 2 * int(pol.REVISIT_MS / 100) + 50)
    assert policy.decisions and all((d.chosen, d.trial, d.sure) == ("round", False, True) for d in policy.decisions)


def test_a_trial_of_slow_verdicts_ends_once_the_lead_is_clear():
    policy = PipelinePolicy(8)
    # stream 2 +- 1 tokens per 20 ms (0.1 per ms); round 5 or 6 per 250 ms (0.022): a verdict a round trip
    noisy(policy, {"stream": ((1, 3), 20.0), "round": ((5, 6), 250.0)}, 200)
    chosen = [(d.chosen, d.trial, d.sure) for d in policy.decisions]
    assert chosen[:2] == [("round", True, False), ("stream", False, True)]
    # round's trial: EARLY_VERDICTS (TRIAL_MS was over after 4), not TRIAL_VERDICTS round trips
    assert policy.decisions[1].rates["round"][1] == pol.EARLY_VERDICTS < pol.TRIAL_VERDICTS


def test_a_trial_of_slow_verdicts_within_the_noise_runs_its_length():
    policy = PipelinePolicy(8)
    # stream 1 +- 1 per 20 ms (0.05 per ms), round 12 +- 4 per 250 ms (0.048): 4 % apart, noisy
    noisy(policy, {"stream": ((0, 2), 20.0), "round": ((8, 16), 250.0)}, 200)
    assert policy.decisions[1].rates["round"][1] == pol.TRIAL_VERDICTS


def test_after_a_switch_to_one_frame_at_a_time_only_its_first_verdict_does_not_count():
    policy = PipelinePolicy(8)
    rates = {"stream": ((1, 3), 20.0)}
    while len(policy.decisions) == 0:  # stream's trial
        noisy(policy, rates, 1)
    assert policy.schedule() is ROUND and policy.measured["round"].n == 0
    streamed = policy.measured["stream"].n
    feed(policy, n=8, schedule="stream", round_ms=20.0, tokens=2)  # the frames stream left in flight drain
    feed(policy, n=3, schedule="round", round_ms=250.0, tokens=5)
    assert policy.measured["round"].n == 2  # the round frames' verdicts but the first
    assert policy.measured["stream"].n == streamed  # the drained frames counted for neither


def test_a_trial_lasts_ten_of_a_frames_trips_within_its_floor_and_cap():
    """At a short round trip a schedule far behind costs a third of a second, not a whole one: a
    trial runs TRIAL_TRIPS of a frame's time from built to verdict, at least TRIAL_MIN_MS (on
    an H100 at 0 ms, stream's first trial was a second of a 3.5 s run at 0.7x round's rate;
    RESULTS, seventh session); at a long one it stays at TRIAL_MS."""
    def verdicts(policy, rtt_ms, n):
        for _ in range(n):
            name = policy.schedule().name
            tokens, ms = (1, 10.0) if name == "stream" else (5, 20.0 + rtt_ms)
            policy.observe(tokens=tokens, sent_bytes=20_000, rtt_ms=rtt_ms, tail_ms=8.0, build_ms=10.0,
                           round_ms=ms, schedule=name)

    near = PipelinePolicy(8)
    verdicts(near, 0.5, 200)
    assert near.trial_ms() == pol.TRIAL_MIN_MS  # 10 trips of ~19 ms: the floor
    first = near.decisions[0]
    assert first.chosen == "round" and first.rates["stream"][1] == pol.TRIAL_MIN_MS / 10.0  # 30, not 100 verdicts
    assert near.decisions[1].chosen == "round" and near.decisions[1].sure
    far = PipelinePolicy(8)
    verdicts(far, 200.0, 200)
    assert far.trial_ms() == pol.TRIAL_MS and far.decisions[0].rates["stream"][1] == pol.TRIAL_MS / 10.0
    mid = PipelinePolicy(8)
    verdicts(mid, 40.0, 1)
    assert mid.trial_ms() == pytest.approx(pol.TRIAL_TRIPS * (10.0 + 40.0 + 8.0))  # build + link + tail


def forecast_run(policy, stream_ms: float, rtt_ms: float, forecast: float, verdicts: int) -> None:
    """Stream's verdicts commit 1 or 3 tokens per ``stream_ms``; round's 5 per trip; every verdict
    brings the tree's ``forecast`` of a frame from the root."""
    for i in range(verdicts):
        name = policy.schedule().name
        tokens, ms = ((1, 3)[i % 2], stream_ms) if name == "stream" else (5, 18.0 + rtt_ms)
        policy.observe(tokens=tokens, sent_bytes=20_000, rtt_ms=rtt_ms, tail_ms=8.0, build_ms=10.0,
                       round_ms=ms, schedule=name, forecast=forecast)


def test_a_round_trial_its_forecast_puts_out_of_reach_is_skipped():
    """The issue's short reply (200 ms, the draft equal to the target, K=4): a round frame commits
    5 tokens a trip of ~218 ms (0.023 per ms), stream 0.1: its trial cost a short reply 7-9 %."""
    policy = PipelinePolicy(8)
    forecast_run(policy, 20.0, 200.0, 5.0, 200)
    assert policy.counts["round"] == 0  # never tried
    first = policy.decisions[0]
    assert (first.chosen, first.trial, first.sure, first.skipped) == ("stream", False, True, "round")
    assert first.forecasts["round"] == pytest.approx(5.0 / (10.0 + 200.0 + 8.0), rel=0.02)
    # after REVISIT_MS the comparison comes again: the forecast still rules the trial out
    forecast_run(policy, 20.0, 200.0, 5.0, int(pol.REVISIT_MS / 20.0) + 10)
    assert policy.counts["round"] == 0 and policy.decisions[1].skipped == "round"


@pytest.mark.parametrize("forecast", [12.0, None])
def test_a_round_trial_within_reach_of_its_forecast_or_without_one_still_runs(forecast):
    policy = PipelinePolicy(8)
    # 12 tokens a trip of ~104 ms forecast (0.115 per ms) against stream's 0.1: worth a trial
    forecast_run(policy, 20.0, 86.0, forecast, 200)
    assert policy.counts["round"] > 0
    assert [(d.chosen, d.trial, d.skipped) for d in policy.decisions][:2] == [("round", True, None),
                                                                           ("stream", False, None)]
    assert ("round" in policy.decisions[0].forecasts) == (forecast is not None)


def test_verdicts_in_flight_that_come_in_a_cycle_measure_a_steady_rate():
    """Frames in flight return in a cycle of the trip (on the simulator at 200 ms: seven verdicts
    16 ms apart, then one after 109 ms, 2 tokens each): batches of a trip see a steady rate where
    the spread verdict by verdict read 18 %; so stream's lead over round's forecast (1.8x: 9
    tokens a 218 ms trip against 0.072 per ms) is clear after its trial and round is not tried."""
    policy = PipelinePolicy(8)
    cycle = [16.0] * 7 + [109.0]
    for i in range(48):
        policy.observe(tokens=2, sent_bytes=20_000, rtt_ms=200.0, tail_ms=8.0, build_ms=10.0,
                       round_ms=cycle[i % 8], schedule="stream", forecast=9.0)
    first = policy.decisions[0]  # after stream's trial (TRIAL_MS: 1000 ms at this trip)
    rate, _, error = first.rates["stream"]
    assert rate == pytest.approx(2 * 8 / sum(cycle), rel=0.05) and error < 0.02 * rate
    assert (first.chosen, first.sure, first.skipped) == ("stream", True, "round")
    assert first.forecasts["round"] == pytest.approx(9.0 / 218.0)


def test_short_of_three_trips_in_flight_the_error_is_taken_verdict_by_verdict():
    """A trial of 1000 ms at a 300 ms trip closes fewer than three batches: the error then comes
    from the verdicts one by one (an overstatement where they cycle), never left unknown."""
    policy = PipelinePolicy(8)
    for i in range(12):
        policy.observe(tokens=(1, 3)[i % 2], sent_bytes=20_000, rtt_ms=280.0, tail_ms=8.0, build_ms=10.0,
                       round_ms=25.0, schedule="stream")
    m = policy.measured["stream"]
    assert m.closed.n < pol.MIN_BATCHES and m.error() == pytest.approx(m.verdicts.error())
    assert 0.0 < m.error() < math.inf
