"""Lossless sampling, the distribution: what the engine samples is what generate() samples.

The first tokens of many seeded speculative replies (a draft that really differs from the
target, K=3, a repetition penalty, temperature, top-k and top-p all active: the target model's
own defaults, from its generation_config.json, which generate() takes too; the penalty of each
node comes from its own path, in chains, trees and frames in flight) are tested against the exact distribution
that ``generate(do_sample=True)`` samples from (the target's logits through transformers' own
warpers, expanded over every prefix) by chi-square goodness-of-fit tests. A large
``generate()`` sample passes the same tests; samples of the same size from slightly wrong
samplers fail them; and a simulation shows that the sample size catches a 5% shift of the
first token's distribution at least 9 times in 10: that is what shows the tests would notice a
broken engine. The models and statistics are in ``sampling_cases``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
from scipy.optimize import brentq

from sampling_cases import (
    ALPHA, K, PROMPT, SAMPLING, VIEWS, combined, describe, generate_sample, gof_pvalue, load,
    parallel_speculative_sample, project, view_pvalues,
)
from sfchat.params import GenParams

# Speculative replies are the costly side (~15 ms each on one core: ~1.7 rounds of 5 forwards;
# they are spread over two processes). 2800 of them catch a smooth shift of 5% of the first
# token's probability mass (total variation 0.05, support kept) in over 90% of samples: see
# test_the_sample_size_catches_a_five_percent_shift.
N_SPEC = 2800
N_GEN = 20_000  # generate() samples are batched and cheap


# -- the distribution -----------------------------------------------------------------------------
def test_the_sample_size_catches_a_five_percent_shift(exact):
    """The tests below at N_SPEC outcomes, on simulated samples of the first token: its exact
    distribution made sharper or flatter (p ** beta, renormalised) until 5% of the probability
    mass has moved, is rejected at least 9 times in 10; the exact distribution itself passes."""
    first = project(exact, (0,))
    keys = list(first)
    p = np.array([first[k] for k in keys])
    threshold = ALPHA / len(VIEWS)  # what one view must fall below for the sample to fail
    rng = np.random.default_rng(2024)

    def rejections(q: np.ndarray, draws: int = 200) -> float:
        failed = 0
        for _ in range(draws):
            counts = Counter(dict(zip(keys, rng.multinomial(N_SPEC, q).tolist())))
            failed += gof_pvalue(counts, first) < threshold
        return failed / draws

    def tempered(beta: float) -> np.ndarray:
        q = p ** beta
        return q / q.sum()

    def moved(q: np.ndarray) -> float:
        return float(np.abs(q - p).sum() / 2)

    assert len(keys) >= 3 and p.max() < 0.9  # a distribution worth shifting
    for lo, hi in ((1.0, 4.0), (0.1, 1.0)):  # sharper, flatter
        beta = brentq(lambda b: moved(tempered(b)) - 0.05, lo, hi)
        rate = rejections(tempered(beta))
        print(f"\n5% shift of token 1 (beta {beta:.3f}): rejected in {rate:.0%} of samples of {N_SPEC}")
        assert rate >= 0.9
    assert rejections(p) <= 0.02


def test_speculative_sampling_is_distributed_as_generate(models, prompt_ids, exact):
    """No sampling setting given on either side: generate() and the engine both sample with the
    model's own generation_config.json (do_sample, temperature, top-k and top-p all set)."""
    # the exact distribution is the one generate() samples from
    p_views = view_pvalues(generate_sample(models["target"], prompt_ids, None, N_GEN, seed=1234), exact)
    print(f"\ngenerate() n={N_GEN} against the exact distribution: {describe(p_views)}")
    assert combined(p_views) > ALPHA, describe(p_views)

    session = load(models)
    assert session.encode(PROMPT) == prompt_ids
    assert session.sampling(GenParams(seed=0)) == replace(SAMPLING, seed=0)  # the model's defaults, no flag given
    spec, histogram = parallel_speculative_sample(models, prompt_ids, None, N_SPEC, first_seed=0)
    # every depth of the walk ran often: 0..K drafts on the committed path
    assert (histogram[:K + 1] >= 150).all(), histogram
    p_views = view_pvalues(spec, exact)
    print(f"speculative n={N_SPEC}, accepted histogram {histogram.tolist()}: {describe(p_views)}")
    assert combined(p_views) > ALPHA, describe(p_views)

    # samplers a little off fail the same tests at the same sample size
    wrong = {
        "temperature 1.0": (models["target"], replace(SAMPLING, temperature=1.0)),
        "temperature 0.9": (models["target"], replace(SAMPLING, temperature=0.9)),
        "top-p ignored": (models["target"], replace(SAMPLING, top_p=1.0)),
        "the repetition penalty ignored": (models["target"], replace(SAMPLING, repetition_penalty=1.0)),
        "the penalty of 1.2": (models["target"], replace(SAMPLING, repetition_penalty=1.2)),
        "the draft's own distribution": (models["draft"], SAMPLING),  # as if every draft were accepted
    }
    for i, (name, (path, s)) in enumerate(wrong.items()):
        p_views = view_pvalues(generate_sample(path, prompt_ids, s, N_SPEC, seed=77 + i), exact)
        print(f"  wrong sampler, {name}: {describe(p_views)}")
        assert combined(p_views) < ALPHA, f"{name} passes: {describe(p_views)}"


def test_tree_sampling_is_distributed_as_generate(models, prompt_ids, exact):
    """Trees of 6 drafts per frame (the draft's likeliest continuations and their siblings): the
    same tests, the same sample size, on other seeds."""
    spec, histogram = parallel_speculative_sample(models, prompt_ids, None, N_SPEC, first_seed=50_000,
                                                  tree_budget=6)
    assert (histogram[:K] >= 200).all(), histogram  # every depth of the walk below K
    p_views = view_pvalues(spec, exact)
    print(f"\ntree speculative n={N_SPEC}, accepted histogram {histogram.tolist()}: {describe(p_views)}")
    assert combined(p_views) > ALPHA, describe(p_views)


def test_sampling_in_flight_draws_exactly_the_sequential_replies(models, prompt_ids):
    """Chains sent three frames ahead of their verdicts (most of their nodes die: the draft disagrees
    often) give, seed by seed, the replies of the sequential chain: each committed token is the
    target's draw at its position from the stream of the seed and that position alone, so the
    distribution is the one the test above checks."""
    n = 300
    sequential, _ = parallel_speculative_sample(models, prompt_ids, SAMPLING, n, first_seed=0)
    ahead, histogram = parallel_speculative_sample(models, prompt_ids, SAMPLING, n, first_seed=0, in_flight=3)
    assert ahead == sequential
    print(f"\nin flight n={n}, accepted histogram {histogram.tolist()}: the same outcomes")


# -- seeds ----------------------------------------------------------------------------------------
