"""The pipeline policy, without models: frame sizes and frames in flight from measured verdicts."""

from __future__ import annotations

from sfchat.engine.policy import EXPLORE_EVERY, PipelinePolicy


def feed(policy, size, n=30, tokens=4, sent_bytes=20_000, rtt_ms=86.0, tail_ms=10.0, build_ms=8.0, overhead_ms=1.0):
    for _ in range(n):
        policy.observe(size, tokens=tokens, sent_bytes=sent_bytes, rtt_ms=rtt_ms, tail_ms=tail_ms, build_ms=build_ms,
                       overhead_ms=overhead_ms)


def test_every_size_is_measured_first_largest_first():
    policy = PipelinePolicy([9, 65, 17], max_in_flight=4)
    seen = []
    for _ in range(3):
        size, m = policy.choose()
        seen.append((size, m))
        feed(policy, size, n=1)
    assert seen == [(65, 1), (17, 1), (9, 1)]


def test_a_long_round_trip_fills_the_pipeline_and_a_short_one_does_not():
    far = PipelinePolicy([65], max_in_flight=8)
    feed(far, 65, rtt_ms=86.0, tail_ms=10.0, build_ms=8.0)
    size, m = far.choose()
    assert size == 65 and m == 8  # (8 + 1 + 86 + 10) / 10 ms: the tail is the slowest stage, ~10 frames wanted
    near = PipelinePolicy([65], max_in_flight=8)
    feed(near, 65, rtt_ms=0.5, tail_ms=10.0, build_ms=8.0)
    assert near.choose() == (65, 2)  # the head and the tail each busy about half the round trip
    alone = PipelinePolicy([65], max_in_flight=1)  # local mode
    feed(alone, 65)
    assert alone.choose() == (65, 1)


def test_the_size_whose_yield_per_spacing_is_highest_wins():
    policy = PipelinePolicy([9, 65], max_in_flight=1)
    feed(policy, 9, tokens=3, build_ms=4.0, tail_ms=4.0, rtt_ms=0.0)
    feed(policy, 65, tokens=4, build_ms=30.0, tail_ms=30.0, rtt_ms=0.0)  # a CPU: compute grows with nodes
    assert policy.choose()[0] == 9
    gpu = PipelinePolicy([9, 65], max_in_flight=1)
    feed(gpu, 9, tokens=3, build_ms=8.0, tail_ms=8.5, rtt_ms=86.0)
    feed(gpu, 65, tokens=5, build_ms=9.0, tail_ms=9.5, rtt_ms=86.0)  # a GPU: nearly flat in nodes
    assert gpu.choose()[0] == 65


def test_the_link_is_fitted_as_latency_plus_bytes_and_sizes_not_chosen_run_now_and_then():
    policy = PipelinePolicy([9, 65], max_in_flight=4)

    def verdict(size):
        small = size == 9
        policy.observe(size, tokens=3 if small else 2, sent_bytes=10_000 if small else 90_000,
                       rtt_ms=50.0 + (10_000 if small else 90_000) * 1e-4, tail_ms=5.0, build_ms=5.0)

    for i in range(60):
        verdict(9 if i % 2 == 0 else 65)
    assert abs(policy.base_ms - 50.0) < 1.0 and abs(policy.ms_per_byte - 1e-4) < 1e-5
    chosen = []
    for _ in range(EXPLORE_EVERY * 2):
        size, _ = policy.choose()
        chosen.append(size)
        verdict(size)
    assert 1 <= chosen.count(65) <= 3 and chosen.count(9) >= 2 * EXPLORE_EVERY - 3  # explored, not adopted
