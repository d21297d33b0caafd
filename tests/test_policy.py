"""PreparePolicy: prepare under the wait when a hit saves more than preparing delays."""

from __future__ import annotations

from sfchat.runtime.policy import PreparePolicy


def feed(policy, n, **round_):
    for _ in range(n):
        policy.observe(**round_)
    return policy


def test_nothing_is_prepared_before_a_round_was_measured():
    assert not PreparePolicy().worth()


def test_a_long_wait_with_accepted_drafts_is_worth_preparing_under():
    p = feed(PreparePolicy(), 5, latency_ms=90.0, compute_ms=18.0, all_accepted=True)
    assert p.worth()


def test_a_draft_that_is_never_fully_accepted_is_not_worth_preparing_for():
    p = feed(PreparePolicy(), 5, latency_ms=90.0, compute_ms=18.0, all_accepted=False)
    assert not p.worth()


def test_a_wait_shorter_than_the_work_is_not_worth_preparing_under_at_low_acceptance():
    p = feed(PreparePolicy(), 5, latency_ms=6.0, compute_ms=18.0, all_accepted=True)
    p = feed(p, 5, latency_ms=6.0, compute_ms=18.0, all_accepted=False)  # acceptance fell to about a third
    assert not p.worth()
    # ... yet worth it where every round accepts everything: a hit saves 18 ms, a miss costs 12
    assert feed(PreparePolicy(), 20, latency_ms=6.0, compute_ms=18.0, all_accepted=True).worth()


def test_measured_penalty_and_wrong_guesses_turn_preparing_off():
    p = feed(PreparePolicy(), 3, latency_ms=37.0, compute_ms=18.0, all_accepted=True)
    assert p.worth()
    # prepared rounds whose verdict was taken 25 ms after it arrived, and whose guess was wrong
    p = feed(p, 10, latency_ms=37.0, compute_ms=18.0, all_accepted=True, prepared_ms=62.0, guess_right=False)
    assert not p.worth()
    p = feed(p, 20, latency_ms=37.0, compute_ms=18.0, all_accepted=True, prepared_ms=37.5, guess_right=True)
    assert p.worth()
