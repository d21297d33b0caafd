"""The pipeline policy, without models: frames in flight from measured verdicts."""

from __future__ import annotations

from sfchat.engine.policy import PipelinePolicy


def feed(policy, n=30, tokens=4, sent_bytes=20_000, rtt_ms=86.0, tail_ms=10.0, build_ms=8.0, overhead_ms=1.0):
    for _ in range(n):
        policy.observe(tokens=tokens, sent_bytes=sent_bytes, rtt_ms=rtt_ms, tail_ms=tail_ms, build_ms=build_ms,
                       overhead_ms=overhead_ms)


def test_one_frame_until_a_steady_frame_was_measured():
    policy = PipelinePolicy(max_in_flight=4)
    assert policy.choose() == 1
    feed(policy, n=1, build_ms=None)  # a first frame carries the prefill: not a steady frame's cost
    assert policy.choose() == 1
    feed(policy, n=1)
    assert policy.choose() > 1


def test_a_long_round_trip_fills_the_pipeline_and_a_short_one_does_not():
    far = PipelinePolicy(max_in_flight=8)
    feed(far, rtt_ms=86.0, tail_ms=10.0, build_ms=8.0)
    assert far.choose() == 8  # (8 + 1 + 86 + 10) / 10 ms: the tail is the slowest stage, ~10 frames wanted
    near = PipelinePolicy(max_in_flight=8)
    feed(near, rtt_ms=0.5, tail_ms=10.0, build_ms=8.0)
    assert near.choose() == 2  # the head and the tail each busy about half the round trip
    alone = PipelinePolicy(max_in_flight=1)  # local mode
    feed(alone)
    assert alone.choose() == 1


def test_the_link_is_fitted_as_latency_plus_bytes():
    policy = PipelinePolicy(max_in_flight=4)
    for i in range(60):  # frames of two byte counts (a prefill, a tree) through a link of 50 ms + 0.1 ms/KB
        sent = 10_000 if i % 2 == 0 else 90_000
        policy.observe(tokens=3, sent_bytes=sent, rtt_ms=50.0 + sent * 1e-4, tail_ms=5.0, build_ms=5.0)
    assert abs(policy.base_ms - 50.0) < 1.0 and abs(policy.ms_per_byte - 1e-4) < 1e-5
    total, stage = policy.timing()
    assert stage == max(5.0, policy.bytes * policy.ms_per_byte) and total > 50.0 + 5.0 + 5.0
