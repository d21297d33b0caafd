"""sfchat.engine.sampling: warp parity with transformers (scalar settings and graph-ready knobs),
the race that draws from it, the repetition penalty from each row's own context, and the
target's picks at the nodes of a tree.

The sampled picks are tested as draws: distributed as ``warp`` (chi-square), the same for the
same (seed, position) whatever the other rows hold, independent across positions.
"""

from collections import Counter
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare
from transformers import (LlamaConfig, LlamaForCausalLM, LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from sfchat.engine.sampling import (Knobs, Seen, exponentials, penalize, picks, race, round_generator, round_seed,
                                    warp)
from sfchat.protocol.wire import Sampling

ALPHA = 1e-3  # chi-square significance; every draw is seeded, so a pass is stable
SETTINGS = [Sampling(1.0, 0, 1.0), Sampling(0.7, 50, 1.0), Sampling(1.3, 0, 0.9),
            Sampling(0.5, 5, 0.5), Sampling(1.0, 1, 1.0), Sampling(0.9, 0, 1e-6),
            Sampling(2.0, 20, 0.95)]


def _hf_warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The processors generate() builds for these settings, in its order."""
    procs = LogitsProcessorList()
    if s.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(s.temperature))
    if s.top_k:
        procs.append(TopKLogitsWarper(top_k=s.top_k, min_tokens_to_keep=1))
    if s.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=s.top_p, min_tokens_to_keep=1))
    return procs(None, logits.float()).softmax(dim=-1)


@pytest.mark.parametrize("s", SETTINGS, ids=str)
def test_warp_matches_transformers_warpers_with_ties(s):
    g = torch.Generator().manual_seed(0)
    # rounded logits create ties at the top-k / top-p boundaries; bf16 checks the float32 cast
    logits = (torch.randn(16, 300, generator=g) * 4).round() / 2
    for x in (logits, logits.bfloat16()):
        assert torch.equal(warp(x, s), _hf_warp(x, s))


def test_warp_matches_generate():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked distributions, so top-k/top-p really cut
    for s in SETTINGS:
        # top_k passed explicitly: generate's default would be 50, ours 0 means "no top-k"
        out = model.generate(torch.tensor([[1, 2, 3]]), do_sample=True, max_new_tokens=3,
                             temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                             output_scores=True, output_logits=True, return_dict_in_generate=True)
        for raw, processed in zip(out.logits, out.scores):
            assert torch.equal(warp(raw, s), processed.softmax(dim=-1)), s


@pytest.fixture
def one_thread():
    # tensors of a few elements: intra-op threads only add barriers, which crawl on a busy box
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("s", SETTINGS, ids=str)
def test_knobs_on_the_device_warp_exactly_as_the_scalar_settings(s):
    """What a captured graph computes from its tensor inputs is what generate() samples from."""
    logits = (torch.randn(8, 200, generator=torch.Generator().manual_seed(3)) * 4).round() / 2
    assert torch.equal(warp(logits, Knobs.of(s, "cpu")), _hf_warp(logits, s))


def test_greedy_picks_are_the_argmax():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1))
    assert torch.equal(picks(logits, [3, 4, 4, 5, 9], Sampling()), logits.argmax(-1))


def test_the_race_draws_in_proportion_to_the_weights(one_thread):
    w = torch.tensor([0.0, 1.0, 2.0, 5.0, 0.5])
    n = 40_000
    noise = exponentials((n, 5), torch.Generator().manual_seed(2))
    counts = Counter(race(w.expand(n, -1), noise).tolist())
    assert counts[0] == 0
    assert chisquare([counts[i] for i in range(1, 5)], (w[1:] / w.sum() * n).tolist()).pvalue > ALPHA


@pytest.mark.parametrize("s", [Sampling(1.0, 0, 1.0), Sampling(0.7, 5, 0.9), Sampling(1.5, 0, 0.8)], ids=str)
def test_sampled_picks_follow_the_targets_warped_distribution(s, one_thread):
    row = torch.randn(1, 12, generator=torch.Generator().manual_seed(7)) * 2
    p = warp(row, s)[0].double()
    n = 6_000
    counts = Counter(picks(row, [pos], replace(s, seed=seed)).item() for seed in range(n) for pos in [11])
    support = [t for t in range(12) if p[t] > 0]
    assert set(counts) <= set(support)
    assert chisquare([counts[t] for t in support], (p[support] / p[support].sum() * n).tolist()).pvalue > ALPHA


def test_a_pick_depends_on_its_seed_and_position_alone():
    s = Sampling(1.0, 0, 1.0, seed=5)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(9))
    alone = [picks(logits[i:i + 1], [10 + i], s).item() for i in range(4)]
    together = picks(logits, [10, 11, 12, 13], s).tolist()
    assert together == alone  # whatever else the frame holds
    siblings = picks(logits[:1].expand(3, -1), [10, 10, 10], s).tolist()
    assert len(set(siblings)) == 1  # one stream per position: siblings draw the same noise
    draws = {tuple(picks(logits[:1].expand(64, -1), list(range(64)), replace(s, seed=seed)).tolist())
             for seed in range(3)}
    assert len(draws) == 3 and all(len(set(d)) > 1 for d in draws)  # positions and seeds differ


def test_round_generator_reproducible_and_independent():
    def draw(seed, pos, role):
        return torch.rand(8, generator=round_generator(seed, pos, role)).tolist()

    assert draw(3, 17, "verify") == draw(3, 17, "verify")  # a retried round
    assert draw(3, 17, "verify") != draw(3, 18, "verify")
    assert draw(3, 17, "verify") != draw(4, 17, "verify")
    assert draw(3, 17, "draft") != draw(3, 17, "verify")
    assert 0 <= round_seed(-1, 2**40, "draft") < 2**64


# -- the repetition penalty -----------------------------------------------------------------------
@pytest.mark.parametrize("penalty", [1.3, 0.7, 10.0])
def test_the_penalty_per_row_equals_transformers_processor_on_each_rows_context(penalty):
    """Rows below one context, each with its own path: ``Seen.rows`` then ``penalize`` give, bit for
    bit, RepetitionPenaltyLogitsProcessor on the row's whole sequence; ids outside the vocabulary
    (context or path) are ignored as generate() ignores them; the counts follow the context as it
    grows, is cut back and grows again."""
    g = torch.Generator().manual_seed(3)
    vocab = 40
    seen = Seen(vocab, "cpu")
    contexts = [[1, 2, 2, 7, 45], [1, 2, 2, 7, 45, 9, 3], [1, 2, 5], [], [1, 2, 5, 39, 39, 0]]
    for context in contexts:
        seen.sync(context)
        paths = [[4], [4, 2], [4, 2, 11], [38, -3, 12, 50]]
        logits = torch.randn(len(paths), vocab, generator=g) * 3
        logits[:, 2] = 0.0
        got = penalize(logits, seen.rows(paths), penalty)
        for row, path in enumerate(paths):
            ids = torch.tensor([[t for t in context + path if t >= 0]])
            want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[row:row + 1].clone())
            assert torch.equal(got[row:row + 1], want), (context, path)
    assert torch.equal(seen.counts[:vocab], torch.bincount(torch.tensor(contexts[-1]), minlength=vocab).int())
    assert penalize(logits, None, 1.0) is logits
    with pytest.raises(ValueError, match="context"):
        penalize(logits, None, 1.2)


def test_picks_apply_the_penalty_before_the_warpers_greedy_and_sampled():
    """Greedy: the penalised argmax; sampled: the same draws as picks over logits that the
    processor penalised first (generate()'s order: the penalty, then temperature, top-k, top-p)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 30, generator=g) * 2
    present = torch.zeros(3, 30, dtype=torch.bool)
    present[:, logits[0].argmax()] = True  # the greedy pick of row 0 is in every row's context
    s = Sampling(0.8, 5, 0.9, seed=7, repetition_penalty=3.0)
    penalised = torch.where(present, torch.where(logits < 0, logits * 3.0, logits / 3.0), logits)
    assert torch.equal(picks(logits, [5, 6, 6], replace(s, temperature=0.0), present), penalised.argmax(-1))
    assert picks(logits, [5, 6, 6], replace(s, temperature=0.0), present)[0] != logits[0].argmax()
    assert torch.equal(picks(logits, [5, 6, 6], s, present),
                       picks(penalised, [5, 6, 6], replace(s, repetition_penalty=1.0)))
