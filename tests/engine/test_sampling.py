"""sfchat.engine.sampling: warp parity with transformers, greedy and sampled verification.

The sampled-verification tests compare verify() against an independent brute-force
enumeration of the rejection-sampling process on tiny vocabularies: exactly (the first
committed token is distributed as p_0) and by Monte Carlo (chi-square on outcome counts).
"""

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from transformers import (LlamaConfig, LlamaForCausalLM, LogitsProcessorList,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from sfchat.engine.sampling import choose, exponentials, round_generator, round_seed, verify, warp
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


def test_greedy_verify_by_hand():
    best = [2, 4, 1, 3]
    logits = torch.zeros(4, 5)
    logits[torch.arange(4), torch.tensor(best)] = 1.0
    no_q = torch.empty(0, 0)  # greedy rounds carry no proposal distributions

    def run(drafts, rows=logits):
        return verify(rows, torch.tensor(drafts, dtype=torch.long), Sampling(), no_q, no_q, None)

    assert run([2, 4, 1]) == (3, [2, 4, 1, 3])  # all accepted, bonus token
    assert run([0, 4, 1]) == (0, [2])  # first rejected: the target's correction
    assert run([2, 4, 0]) == (2, [2, 4, 1])
    assert run([2, 999, 1]) == (1, [2, 4])  # a token the target vocabulary lacks
    assert run([], logits[:1]) == (0, [2])  # K = 0


def test_choose_greedy():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(1))
    tokens, q_idx, q_prob = choose(logits, Sampling(), 4, None)
    assert torch.equal(tokens, logits.argmax(dim=-1)) and tokens.dtype == torch.long
    assert q_idx.shape == q_prob.shape == (3, 0)
    assert q_idx.dtype == torch.int32 and q_prob.dtype == torch.float32


def test_choose_sampled_proposal_and_determinism():
    s = Sampling(0.8, 6, 0.95)
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(2)) * 2
    tokens, q_idx, q_prob = choose(logits, s, 4, exponentials((logits.shape[0], 4), round_generator(7, 0, "draft")))
    assert tokens.shape == (3,) and tokens.dtype == torch.long
    assert q_idx.shape == q_prob.shape == (3, 4)
    assert q_idx.dtype == torch.int32 and q_prob.dtype == torch.float32
    top = torch.topk(warp(logits, s), 4, dim=-1)
    assert torch.equal(q_idx.long(), top.indices)
    torch.testing.assert_close(q_prob, top.values / top.values.sum(-1, keepdim=True))
    assert all(t in row for t, row in zip(tokens.tolist(), q_idx.tolist()))
    again = choose(logits, s, 4, exponentials((logits.shape[0], 4), round_generator(7, 0, "draft")))
    assert all(torch.equal(a, b) for a, b in zip((tokens, q_idx, q_prob), again))
    # a support narrower than n_q (top_k=2) and a vocabulary narrower than n_q: zero padding
    _, idx, prob = choose(logits[:, :6], Sampling(1.0, 2, 1.0), 8, exponentials((logits.shape[0], 8), None))
    assert prob.shape == (3, 8) and (prob[:, 2:] == 0).all()
    torch.testing.assert_close(prob.sum(-1), torch.ones(3))


@pytest.mark.parametrize("s", [Sampling(0.7, 1, 1.0), Sampling(1.5, 0, 1e-6)], ids=str)
def test_single_token_settings_act_greedily(s):
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5)) * 3
    best = logits.argmax(dim=-1)
    for seed in range(20):
        tokens, q_idx, q_prob = choose(logits[:3], s, 4, exponentials((3, 4), round_generator(seed, 0, "draft")))
        assert torch.equal(tokens, best[:3])
        assert verify(logits, tokens, s, q_idx, q_prob, round_generator(seed, 0, "verify")) \
            == (3, best.tolist())


def test_choose_samples_from_q():
    s = Sampling(1.2, 0, 0.97)
    row = torch.randn(1, 20, generator=torch.Generator().manual_seed(3))
    n = 40_000
    tokens, q_idx, q_prob = choose(row.expand(n, -1), s, 6, exponentials((n, 6), round_generator(3, 0, "draft")))
    support, q = q_idx[0].long(), q_prob[0].double()
    counts = Counter(tokens.tolist())
    assert set(counts) <= set(support.tolist())
    observed = [counts[t] for t in support.tolist()]
    assert chisquare(observed, (q * n / q.sum()).tolist()).pvalue > ALPHA


def _dense(probs: list[list[float]], width: int) -> torch.Tensor:
    """Rows padded to ``width`` and renormalised in float64, so the theorem holds to 1e-12."""
    rows = torch.tensor([r + [0.0] * (width - len(r)) for r in probs], dtype=torch.float64)
    return rows / rows.sum(dim=-1, keepdim=True)


def _outcomes(p: torch.Tensor, q: torch.Tensor) -> dict[tuple, float]:
    """Brute force: probability of each (n_accepted, tokens) when d_i ~ q_i, verified against p.

    p (K+1, W), q (K, W) on one padded vocabulary of width W; written from the algorithm's
    definition, independently of verify()'s tensor formulation.
    """
    k, width = q.shape
    out: Counter = Counter()

    def walk(i: int, prefix: tuple, mass: float) -> None:
        if i == k:
            for t in range(width):
                out[(k, prefix + (t,))] += mass * p[k, t].item()
            return
        residual = (p[i] - q[i]).clamp(min=0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[i]
        for d in range(width):
            if q[i, d] == 0:
                continue
            accept = min(1.0, (p[i, d] / q[i, d]).item())
            walk(i + 1, prefix + (d,), mass * q[i, d].item() * accept)
            for t in range(width):
                out[(i, prefix + (t,))] += mass * q[i, d].item() * (1 - accept) * residual[t].item()

    walk(0, (), 1.0)
    return {key: v for key, v in out.items() if v > 0}


# (target p rows over V_target, draft q' rows over V_draft); 0 entries in p are -inf logits.
CASES = {
    "k1-wider-p": ([[.1, .2, .3, .15, .25], [.2, .2, .2, .2, .2]], [[.5, .5]]),
    "k1-q-where-p-is-0": ([[.0, .4, .0, .6, .0, .0], [.1, .1, .1, .1, .1, .5]],
                          [[.3, .1, .4, .0, .2, .0]]),
    "k2-mixed": ([[.3, .3, .2, .1, .1], [.0, .5, .5, .0, .0], [.1, .2, .3, .2, .2]],
                 [[.1, .1, .2, .3, .3], [.6, .0, .4, .0, .0]]),
    "k2-draft-vocab-wider": ([[.2, .2, .2, .2, .1, .1], [.4, .3, .3, .0, .0, .0],
                              [.1, .1, .1, .1, .1, .5]],
                             [[.2, .1, .1, .1, .1, .1, .2, .1], [.3, .0, .2, .1, .0, .0, .1, .3]]),
}


def _case(name):
    p_rows, q_rows = CASES[name]
    width = max(len(p_rows[0]), len(q_rows[0]))
    logits = torch.tensor(p_rows).log()
    s = Sampling(temperature=1.0)
    p = _dense(warp(logits, s).double().tolist(), width)
    q = _dense(q_rows, width)
    q_idx = torch.arange(len(q_rows[0]), dtype=torch.int32).expand(len(q_rows), -1)
    return logits, s, p, q, q_idx, torch.tensor(q_rows)


@pytest.mark.parametrize("name", CASES)
def test_first_token_is_distributed_as_p0(name):
    _, _, p, q, _, _ = _case(name)
    first = torch.zeros(p.shape[1], dtype=torch.float64)
    for (_, tokens), prob in _outcomes(p, q).items():
        first[tokens[0]] += prob
    torch.testing.assert_close(first, p[0], rtol=0, atol=1e-12)


@pytest.fixture
def one_thread():
    # tensors of a few elements: intra-op threads only add barriers, which crawl on a busy box
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# verify() is called once per draw (~0.3 ms on CPU): K=1 has 42 outcomes, K=2 several hundred
@pytest.mark.parametrize("name, n", [("k1-q-where-p-is-0", 10_000), ("k2-draft-vocab-wider", 20_000)])
def test_verify_outcome_frequencies(name, n, one_thread):
    logits, s, p, q, q_idx, q_prob = _case(name)
    expected = _outcomes(p, q)
    drafts = torch.multinomial(q.float(), n, replacement=True,
                               generator=torch.Generator().manual_seed(11)).T
    counts = Counter()
    for i in range(n):
        n_acc, tokens = verify(logits, drafts[i], s, q_idx, q_prob, round_generator(5, i, "verify"))
        assert len(tokens) == n_acc + 1
        counts[(n_acc, tuple(tokens))] += 1
    assert set(counts) <= set(expected), set(counts) - set(expected)
    # pool outcomes too rare for the chi-square approximation into one bin
    big = [key for key, v in expected.items() if v * n >= 5]
    rest = [key for key in expected if key not in big]
    observed = [counts[key] for key in big]
    exp = [expected[key] * n for key in big]
    if rest:
        observed.append(sum(counts[key] for key in rest))
        exp.append(sum(expected[key] for key in rest) * n)
    scale = n / sum(exp)
    assert chisquare(observed, [e * scale for e in exp]).pvalue > ALPHA


def test_vocab_mismatch_rejects_without_error():
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(4))
    s = Sampling(1.0, 0, 1.0)
    q_idx = torch.tensor([[7, 9, 2, -3]], dtype=torch.int32)  # draft vocab 10 (and garbage)
    q_prob = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    for seed in range(200):
        n_acc, tokens = verify(logits, torch.tensor([7]), s, q_idx, q_prob,
                               round_generator(seed, 0, "verify"))
        assert n_acc == 0 and 0 <= tokens[0] < 6


def test_degenerate_residual_falls_back_to_p():
    # q' = 2p is not a distribution, but it makes p - q' <= 0 everywhere after a rejection
    p = torch.tensor([[0.0, 0.5, 0.3, 0.2], [0.25] * 4])
    q_idx = torch.arange(4, dtype=torch.int32)[None]
    seen = Counter()
    for seed in range(300):
        n_acc, tokens = verify(p.log(), torch.tensor([1]), Sampling(1.0), q_idx, 2 * p[:1],
                               round_generator(seed, 0, "verify"))
        seen[n_acc] += 1
        assert tokens[0] in (1, 2, 3)
    assert seen[0] > 0 and seen[1] > 0


def test_sampled_verify_without_proposals_is_an_error():
    with pytest.raises(ValueError):
        verify(torch.zeros(2, 4), torch.tensor([1]), Sampling(1.0), torch.empty(1, 0),
               torch.empty(1, 0), None)


def test_round_generator_reproducible_and_independent():
    def draw(seed, pos, role):
        return torch.rand(8, generator=round_generator(seed, pos, role)).tolist()

    assert draw(3, 17, "verify") == draw(3, 17, "verify")  # a retried round
    assert draw(3, 17, "verify") != draw(3, 18, "verify")
    assert draw(3, 17, "verify") != draw(4, 17, "verify")
    assert draw(3, 17, "draft") != draw(3, 17, "verify")
    assert 0 <= round_seed(-1, 2**40, "draft") < 2**64
