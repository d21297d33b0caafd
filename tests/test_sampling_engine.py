"""Lossless sampling through the real engine: ChatSession, draft, head slice, wire, tail, CLI.

tests/test_sampling.py proves the sampling math on hand-made distributions; these tests prove
that the engine as wired together samples exactly what ``generate(do_sample=True)`` samples:

* the first tokens of many seeded speculative replies (a draft that really differs from the
  target, K=3, temperature, top-k and top-p all active) against the exact distribution that
  ``generate(do_sample=True)`` samples from (the target's logits through transformers' own
  warpers, expanded over every prefix), by chi-square goodness-of-fit tests; a large
  ``generate()`` sample passes the same tests, samples of the same size from slightly wrong
  samplers fail them, and a simulation shows that the sample size catches a 5% shift of the
  first token's distribution 9 times in 10, which is what shows they would notice a broken
  engine;
* seeds: the same seed gives the same reply (new session or reused), another seed another
  reply, temperature 0 is still greedy ``generate()``; the CLI's flags reach the sampler;
* a draft whose vocabulary is larger than the target's;
* the draft's sparse q' travels in every sampled VERIFY frame and is what the tail verifies with.

The models are built here rather than taken from the ``zoo``: a 64-token vocabulary (with its
own tokenizer) keeps the outcomes few, and a draft made of the target minus its (damped) second
layer has about 65% of its proposals accepted, so that every path of verification is frequent:
accept, reject and resample from the residual, all K accepted and the bonus token.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import chisquare
from transformers import (
    AutoModelForCausalLM, LogitsProcessorList, PreTrainedTokenizerFast, TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper,
)

import tinymodels
from sfchat import wire
from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.runtime import tail as tail_module
from sfchat.runtime.draft import Drafter
from sfchat.runtime.links import MemoryLink
from sfchat.runtime.session import ChatSession
from sfchat.runtime.tail import Verifier
from sfchat.wire import Sampling

REPO = Path(__file__).resolve().parent.parent
PROMPT = [{"role": "user", "content": "hello world"}]
VOCAB, WIDE_VOCAB = 64, 96
K = 3
SAMPLING = Sampling(temperature=0.8, top_k=5, top_p=0.9)
N_NEW = 4  # tokens per sampled reply: the 4th is the bonus token whenever round 1 accepts all K
# Every draw is seeded, so each p-value below is the same on every run. A sample fails when the
# smallest p-value of its views is below ALPHA / (number of views) (Bonferroni).
ALPHA = 0.01
# Speculative replies are the costly side (~15 ms each on one core: ~1.7 rounds of 5 forwards;
# they are spread over two processes). 2800 of them catch a smooth shift of 5% of the first
# token's probability mass (total variation 0.05, support kept) in over 90% of samples: see
# test_the_sample_size_catches_a_five_percent_shift.
N_SPEC = 2800
N_GEN = 20_000  # generate() samples are batched and cheap
N_WIDE = 200
# what the tests compare: each token's own distribution, and the joint one of all four
VIEWS = {"token 1": (0,), "token 2": (1,), "token 3": (2,), "token 4": (3,), "tokens 1-4": (0, 1, 2, 3)}


# -- tiny models ----------------------------------------------------------------------------------
def make_small_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE over the corpus' own characters (tinymodels' keeps all 256 bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=tinymodels.SPECIALS)
    tk.train_from_iterator(tinymodels.CORPUS + ["<|im_start|>user\nhi<|im_end|>\n"], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token=None)
    tok.chat_template = tinymodels.CHAT_TEMPLATE
    tok.save_pretrained(path)
    return tok


def new_model(vocab: int, layers: int, seed: int):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tinymodels.config_for("llama", vocab, layers=layers, hidden=32)).eval()


def save(model, tok, path: Path) -> Path:
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling-models")
    tok = make_small_tokenizer(root / "tokenizer")
    assert len(tok) == VOCAB
    target = new_model(VOCAB, 2, seed=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.6)  # spread-out distributions, which top-k and top-p both cut
        layer = target.model.layers[1]  # a quieter second layer keeps the draft below close
        layer.self_attn.o_proj.weight.mul_(0.3)
        layer.mlp.down_proj.weight.mul_(0.3)
    draft = new_model(VOCAB, 1, seed=2)  # the target without its second layer
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.1")})
    # the same draft plus 32 tokens the target lacks, which make ~14% of its sampled proposals
    wide = new_model(WIDE_VOCAB, 1, seed=3)
    state = wide.state_dict()
    for name, value in draft.state_dict().items():
        state[name][:value.shape[0]] = value
    state["lm_head.weight"][VOCAB:] *= 0.5
    wide.load_state_dict(state)
    return {"tokenizer": tok, "target": save(target, tok, root / "target"),
            "draft": save(draft, tok, root / "draft"), "wide-draft": save(wide, tok, root / "wide-draft")}


@pytest.fixture(scope="module")
def prompt_ids(models) -> list[int]:
    tok = models["tokenizer"]
    return tok(tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"]


def load(models, draft="draft", link=None) -> ChatSession:
    return ChatSession.load(Settings(model=str(models["target"]), draft=str(models[draft]), k=K, device="cpu"),
                            link=link)


def reply(session, ids, n, s) -> ReplyFinished:
    final = list(session.reply(ids, n, s))[-1]
    assert isinstance(final, ReplyFinished)
    return final


def greedy_generate(models, ids, n) -> list[int]:
    target = AutoModelForCausalLM.from_pretrained(models["target"]).eval()
    out = target.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


# -- samples and the two-sample tests -----------------------------------------------------------
def outcome(tokens, eos: int) -> tuple:
    """The first N_NEW tokens, cut after EOS and padded with -1 (both samplers stop at EOS)."""
    tokens = list(tokens)[:N_NEW]
    if eos in tokens:
        tokens = tokens[:tokens.index(eos) + 1]
    return tuple(tokens) + (-1,) * (N_NEW - len(tokens))


def speculative_sample(session, ids, s: Sampling, n: int, first_seed: int):
    """Outcome counts of ``n`` replies seeded first_seed, first_seed + 1, ...; summed accepted histogram."""
    (eos,) = session.eos
    counts, histogram = Counter(), np.zeros(K + 1, dtype=int)
    for i in range(n):
        final = reply(session, ids, N_NEW, replace(s, seed=first_seed + i))
        counts[outcome(final.token_ids, eos)] += 1
        histogram += final.accepted_histogram
    return counts, histogram


def generate_sample(path, ids, s: Sampling, n: int, seed: int, batch: int = 4000) -> Counter:
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    eos = model.generation_config.eos_token_id
    torch.manual_seed(seed)
    counts = Counter()
    for done in range(0, n, batch):
        prompt = torch.tensor([ids]).expand(min(batch, n - done), -1)
        # top_k always explicit: generate's default would be 50, Sampling's 0 means "off"
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                             temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, max_new_tokens=N_NEW,
                             pad_token_id=model.generation_config.pad_token_id)
        counts.update(outcome(row, eos) for row in out[:, len(ids):].tolist())
    return counts


def exact_outcomes(path, ids, s: Sampling) -> dict[tuple, float]:
    """The probability of every outcome (see ``outcome``) under ``generate(do_sample=True)``: the
    model's next-token logits (float32, as generate casts them) through transformers' own
    temperature, top-k and top-p warpers in generate's order, expanded over every prefix."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    eos = model.generation_config.eos_token_id
    warpers = LogitsProcessorList([TemperatureLogitsWarper(s.temperature), TopKLogitsWarper(s.top_k),
                                   TopPLogitsWarper(s.top_p)])
    probs, frontier = {}, {(): 1.0}
    for depth in range(N_NEW):
        prefixes = list(frontier)
        x = torch.tensor([ids + list(p) for p in prefixes])
        with torch.no_grad():
            nxt = warpers(x, model(x).logits[:, -1].float()).double().softmax(-1)
        grown = {}
        for prefix, row in zip(prefixes, nxt):
            for t in row.nonzero().flatten().tolist():
                seq, pr = prefix + (t,), frontier[prefix] * row[t].item()
                if t == eos or depth == N_NEW - 1:
                    probs[seq + (-1,) * (N_NEW - len(seq))] = pr
                else:
                    grown[seq] = pr
        frontier = grown
    assert abs(sum(probs.values()) - 1) < 1e-9
    return probs


def project(dist: dict, idx: tuple) -> Counter:
    """Counts or probabilities of outcomes, summed over what the view ``idx`` does not look at."""
    out = Counter()
    for key, n in dist.items():
        out[tuple(key[i] for i in idx)] += n
    return out


def gof_pvalue(counts: Counter, probs: dict) -> float:
    """Chi-square goodness of fit of a sample to exact probabilities.

    Outcomes expected fewer than 5 times share one pooled cell (the chi-square approximation
    needs that); which ones depends on the probabilities alone. An outcome of probability 0
    in the sample is a certain failure.
    """
    n = sum(counts.values())
    if any(key not in probs for key in counts):
        return 0.0
    observed, expected, rest = [], [], [0, 0.0]
    for key in sorted(probs, key=probs.get, reverse=True):
        if n * probs[key] >= 5:
            observed.append(counts.get(key, 0))
            expected.append(n * probs[key])
        else:
            rest[0] += counts.get(key, 0)
            rest[1] += n * probs[key]
    if rest[1] >= 5 or len(expected) < 2:
        observed.append(rest[0])
        expected.append(rest[1])
    else:  # too little to stand alone: joined to the least likely cell
        observed[-1] += rest[0]
        expected[-1] += rest[1]
    expected = np.array(expected) * n / sum(expected)  # float rounding of the probabilities
    return float(chisquare(observed, expected).pvalue)


def view_pvalues(counts: Counter, probs: dict) -> dict[str, float]:
    return {name: gof_pvalue(project(counts, idx), project(probs, idx)) for name, idx in VIEWS.items()}


def combined(p_views: dict[str, float]) -> float:
    """The views' smallest p-value, Bonferroni-corrected: below ALPHA means "not that distribution"."""
    return min(1.0, len(p_views) * min(p_views.values()))


def describe(p_views: dict[str, float]) -> str:
    return ", ".join(f"{name} {p:.3g}" for name, p in p_views.items())


@pytest.fixture(scope="module")
def exact(models, prompt_ids) -> dict[tuple, float]:
    return exact_outcomes(models["target"], prompt_ids, SAMPLING)


def _speculative_part(target, draft, ids, s: Sampling, n: int, first_seed: int):
    """One worker's share of ``speculative_sample`` (a process of its own: it loads its session)."""
    torch.set_num_threads(1)
    session = ChatSession.load(Settings(model=target, draft=draft, k=K, device="cpu"))
    return speculative_sample(session, ids, s, n, first_seed)


def parallel_speculative_sample(models, ids, s: Sampling, n: int, first_seed: int):
    """``speculative_sample`` over two processes when there are two cores: the same seeds, so
    the same outcomes as one process would give."""
    workers = min(2, os.cpu_count() or 1)
    shares = [(first_seed + i * n // workers, (i + 1) * n // workers - i * n // workers) for i in range(workers)]
    counts, histogram = Counter(), np.zeros(K + 1, dtype=int)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = [pool.submit(_speculative_part, str(models["target"]), str(models["draft"]), ids, s, size, seed)
                 for seed, size in shares]
        for part in parts:
            c, h = part.result()
            counts.update(c)
            histogram += h
    return counts, histogram


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
    # the exact distribution is the one generate() samples from
    p_views = view_pvalues(generate_sample(models["target"], prompt_ids, SAMPLING, N_GEN, seed=1234), exact)
    print(f"\ngenerate() n={N_GEN} against the exact distribution: {describe(p_views)}")
    assert combined(p_views) > ALPHA, describe(p_views)

    assert load(models).encode(PROMPT) == prompt_ids
    spec, histogram = parallel_speculative_sample(models, prompt_ids, SAMPLING, N_SPEC, first_seed=0)
    # every path of verification ran hundreds of times: 0..K drafts accepted (K: the bonus token)
    assert (histogram >= 400).all(), histogram
    p_views = view_pvalues(spec, exact)
    print(f"speculative n={N_SPEC}, accepted histogram {histogram.tolist()}: {describe(p_views)}")
    assert combined(p_views) > ALPHA, describe(p_views)

    # samplers a little off fail the same tests at the same sample size
    wrong = {
        "temperature 1.0": (models["target"], replace(SAMPLING, temperature=1.0)),
        "temperature 0.9": (models["target"], replace(SAMPLING, temperature=0.9)),
        "top-p ignored": (models["target"], replace(SAMPLING, top_p=1.0)),
        "the draft's own distribution": (models["draft"], SAMPLING),  # as if every draft were accepted
    }
    for i, (name, (path, s)) in enumerate(wrong.items()):
        p_views = view_pvalues(generate_sample(path, prompt_ids, s, N_SPEC, seed=77 + i), exact)
        print(f"  wrong sampler, {name}: {describe(p_views)}")
        assert combined(p_views) < ALPHA, f"{name} passes: {describe(p_views)}"


# -- seeds ----------------------------------------------------------------------------------------
def test_seeded_replies_are_reproducible(models, prompt_ids):
    s = replace(SAMPLING, seed=5)
    fresh = [reply(load(models), prompt_ids, 16, s).token_ids for _ in range(2)]
    session = load(models)
    first = reply(session, prompt_ids, 16, s).token_ids
    other = reply(session, prompt_ids, 16, replace(s, seed=6)).token_ids
    again = reply(session, prompt_ids, 16, s).token_ids
    # the same seed, the same tokens: in a new session, or in one that has served other replies
    assert fresh[0] == fresh[1] == first == again
    assert other != first
    assert len({reply(session, prompt_ids, 16, replace(s, seed=seed)).token_ids for seed in range(10, 14)}) == 4
    # after sampled replies, temperature 0 is still exactly greedy generate()
    greedy = reply(session, prompt_ids, 16, Sampling(seed=5)).token_ids
    assert list(greedy) == greedy_generate(models, prompt_ids, 16)


# -- the CLI --------------------------------------------------------------------------------------
CLI_SAMPLING = Sampling(temperature=0.7, top_k=20, top_p=0.9)
CLI_NEW = 16


@pytest.fixture(scope="module", autouse=True)
def cli_runs(models, tmp_path_factory):
    """seed -> Future of ``python -m sfchat.cli ... --seed SEED --json``.

    Started before the module's first test, so that the subprocesses' seconds of imports overlap
    the single-threaded tests in this process instead of adding to them.
    """
    home = tmp_path_factory.mktemp("cli-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SFCHAT_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               XDG_CONFIG_HOME=str(home / "config"), XDG_DATA_HOME=str(home / "data"),
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    s = CLI_SAMPLING
    args = [sys.executable, "-m", "sfchat.cli", "--model", str(models["target"]), "--draft", str(models["draft"]),
            "--k", str(K), "--device", "cpu", "--prompt", PROMPT[0]["content"], "--max-new-tokens", str(CLI_NEW),
            "--temperature", str(s.temperature), "--top-k", str(s.top_k), "--top-p", str(s.top_p), "--json"]

    def run(seed):
        return subprocess.run(args + ["--seed", str(seed)], cwd=home, env=env, capture_output=True, text=True,
                              timeout=300)

    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {seed: pool.submit(run, seed) for seed in (3, 4)}


def test_cli_sampling_flags_and_seed(models, prompt_ids, cli_runs):
    session = load(models)

    def here(s: Sampling) -> list[int]:
        return list(reply(session, prompt_ids, CLI_NEW, s).token_ids)

    token_ids = {}
    for seed, future in cli_runs.items():
        done = future.result()
        assert done.returncode == 0, done.stderr
        token_ids[seed] = json.loads(done.stdout)["token_ids"]
        # another process, and the same tokens as the same settings give here: a seeded run is
        # reproducible from one process to the next
        assert token_ids[seed] == here(replace(CLI_SAMPLING, seed=seed))
    assert token_ids[3] != token_ids[4]
    # and every flag reached the sampler: changing any one of them changes the reply
    s = replace(CLI_SAMPLING, seed=3)
    for changed in (replace(s, temperature=1.5), replace(s, top_k=2), replace(s, top_p=0.5), replace(s, seed=0)):
        assert here(changed) != token_ids[3], changed


# -- frames on the wire ---------------------------------------------------------------------------
class FrameLog:
    """A link wrapper that keeps, decoded, every FORWARD frame the head sends."""

    def __init__(self, link):
        self.link, self.forwards = link, []

    def send(self, frame: bytes) -> None:
        msg = wire.decode(frame)
        if isinstance(msg, wire.Forward):
            self.forwards.append(msg)
        self.link.send(frame)

    def recv(self, timeout=None) -> bytes:
        return self.link.recv(timeout)

    def close(self) -> None:
        self.link.close()

    def verifies(self) -> list[wire.Forward]:
        return [f for f in self.forwards if f.want_verdict]

    def drafts(self) -> list[int]:
        return [t for f in self.verifies() for t in f.tokens[len(f.tokens) - f.n_draft:]]


def logged(models, draft="draft") -> tuple[ChatSession, FrameLog]:
    log = FrameLog(MemoryLink(Verifier(torch.device("cpu"))))
    return load(models, draft, link=log), log


# -- a draft vocabulary larger than the target's ------------------------------------------------
def test_draft_with_a_larger_vocabulary(models, prompt_ids, exact):
    session, log = logged(models, "wide-draft")
    assert session.engine.drafter.vocab == WIDE_VOCAB > session.engine.head.config.vocab_size == VOCAB
    assert list(reply(session, prompt_ids, 24, Sampling()).token_ids) == greedy_generate(models, prompt_ids, 24)
    log.forwards.clear()
    wide, _ = speculative_sample(session, prompt_ids, SAMPLING, N_WIDE, first_seed=10_000)
    drafts = np.array(log.drafts())
    assert (drafts >= VOCAB).mean() > 0.05  # tokens the target lacks were proposed (and rejected)
    assert all(t < VOCAB for key in wide for t in key)
    p_views = view_pvalues(wide, exact)
    print(f"\nwide draft n={N_WIDE}: {describe(p_views)}")
    assert combined(p_views) > ALPHA, describe(p_views)


# -- q' on the wire -------------------------------------------------------------------------------
def test_sampled_rounds_send_q_and_the_tail_verifies_with_it(models, prompt_ids, monkeypatch):
    proposed, verified = [], []
    propose, verify = Drafter.propose, tail_module.sampling.verify

    def spy_propose(self, tokens, s, generator):
        proposed.append(propose(self, tokens, s, generator))
        return proposed[-1]

    def spy_verify(logits, drafts, s, q_idx, q_prob, generator):
        verified.append((drafts.tolist(), q_idx.clone(), q_prob.clone()))
        return verify(logits, drafts, s, q_idx, q_prob, generator)

    monkeypatch.setattr(Drafter, "propose", spy_propose)
    monkeypatch.setattr(tail_module.sampling, "verify", spy_verify)
    session, log = logged(models)
    n_q = session.engine.drafter.n_q
    reply(session, prompt_ids, 20, replace(SAMPLING, seed=1))
    frames = log.verifies()
    assert len(frames) == len(proposed) == len(verified) > 1
    for frame, (drafts, q_idx, q_prob), (got_drafts, got_idx, got_prob) in zip(frames, proposed, verified):
        assert frame.n_draft == K and frame.n_q == n_q > 0
        sent_idx = np.frombuffer(frame.q_indices, dtype="<i4").reshape(K, n_q)
        sent_prob = np.frombuffer(frame.q_probs, dtype="<f4").reshape(K, n_q)
        # what the draft sampled from is what was sent, and what the tail verified against
        assert np.array_equal(sent_idx, q_idx.numpy()) and np.array_equal(sent_prob, q_prob.numpy())
        assert got_drafts == drafts and torch.equal(got_idx, q_idx) and torch.equal(got_prob, q_prob)
        np.testing.assert_allclose(sent_prob.sum(axis=1), 1, rtol=1e-5)
        assert all(p[list(idx).index(d)] > 0 for d, idx, p in zip(drafts, sent_idx, sent_prob))
    # greedy rounds carry no distribution at all
    log.forwards.clear()
    verified.clear()
    reply(session, prompt_ids, 12, Sampling())
    assert log.verifies() and all(f.n_q == 0 and f.q_indices == f.q_probs == b"" for f in log.verifies())
    assert verified and all(got_idx.shape == (K, 0) for _, got_idx, _ in verified)
