"""Shared by the sampling tests that run the real engine: tiny models built for sampling, and the
statistics that compare samples of replies with the exact distribution generate() samples from.

The models are built here rather than taken from the ``zoo``: a 64-token vocabulary (with its
own tokenizer) keeps the outcomes few, and a draft made of the target minus its (damped) second
layer proposes the target's draw often enough that every depth of the walk is frequent: no draft
on the committed path, some, all K.

An outcome is a reply's first N_NEW tokens (cut after EOS, padded with -1); a view looks at some
of its positions; a sample fails when the smallest chi-square goodness-of-fit p-value of its
views against the exact probabilities, Bonferroni-corrected (``combined``), is below ALPHA.
Speculative samples can be drawn over two processes (``parallel_speculative_sample``). The
fixtures ``models``, ``prompt_ids`` and ``exact`` (tests/conftest.py) are built from this module.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from scipy.stats import chisquare
from transformers import (
    AutoModelForCausalLM, LogitsProcessorList, PreTrainedTokenizerFast, RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

import tinymodels
from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.node.head import Head
from sfchat.params import GenParams
from sfchat.protocol import wire
from sfchat.protocol.wire import Sampling

PROMPT = [{"role": "user", "content": "hello world"}]
VOCAB, WIDE_VOCAB = 64, 96
K = 3
# every warper generate() applies, the repetition penalty (which depends on each node's path) too
SAMPLING = Sampling(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.3)
N_NEW = 4  # tokens per sampled reply: the 4th is the bonus token whenever round 1 accepts all K
# Every draw is seeded, so each p-value is the same on every run.
ALPHA = 0.01
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
    """The model and tokenizer at ``path``; its generation_config.json asks for SAMPLING, as a chat
    model's authors ship their defaults (the engine must sample them exactly when no flag is given)."""
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.do_sample = True
    model.generation_config.temperature = SAMPLING.temperature
    model.generation_config.top_k = SAMPLING.top_k
    model.generation_config.top_p = SAMPLING.top_p
    model.generation_config.repetition_penalty = SAMPLING.repetition_penalty
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build_models(root: Path) -> dict:
    """The tokenizer and the target, draft and wide-draft model directories, written under ``root``."""
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


def prompt_ids_for(models: dict) -> list[int]:
    tok = models["tokenizer"]
    return tok(tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"]


def load(models, draft="draft", link=None) -> Head:
    return Head.open(Settings(model=str(models["target"]), draft=str(models[draft]), k=K, device="cpu"),
                            link=link)


def reply(session, ids, n, s) -> ReplyFinished:
    final = list(session.reply(ids, n, s))[-1]
    assert isinstance(final, ReplyFinished)
    return final


def greedy_generate(models, ids, n, repetition_penalty: float = 1.0) -> list[int]:
    """generate(do_sample=False) with this penalty (the model's generation_config.json has its own)."""
    target = AutoModelForCausalLM.from_pretrained(models["target"]).eval()
    out = target.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                          repetition_penalty=repetition_penalty)
    return out[0, len(ids):].tolist()


# -- samples and the goodness-of-fit tests -------------------------------------------------------
def outcome(tokens, eos: int) -> tuple:
    """The first N_NEW tokens, cut after EOS and padded with -1 (both samplers stop at EOS)."""
    tokens = list(tokens)[:N_NEW]
    if eos in tokens:
        tokens = tokens[:tokens.index(eos) + 1]
    return tuple(tokens) + (-1,) * (N_NEW - len(tokens))


def speculative_sample(session, ids, s: Sampling | None, n: int, first_seed: int):
    """Outcome counts of ``n`` replies seeded first_seed, first_seed + 1, ...; summed accepted
    histogram. ``s`` None: the head's own sampling, no setting given (the model's defaults)."""
    (eos,) = session.eos
    counts, histogram = Counter(), np.zeros(wire.MAX_NODES, dtype=int)
    for i in range(n):
        drawn = session.sampling(GenParams(seed=first_seed + i)) if s is None else replace(s, seed=first_seed + i)
        final = reply(session, ids, N_NEW, drawn)
        counts[outcome(final.token_ids, eos)] += 1
        histogram[:len(final.accepted_histogram)] += final.accepted_histogram
    return counts, histogram


def generate_sample(path, ids, s: Sampling | None, n: int, seed: int, batch: int = 4000) -> Counter:
    """Outcome counts of ``n`` replies of ``generate()``: sampled with ``s``, or with None as the
    model's own generation_config.json says (no sampling argument given)."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    eos = model.generation_config.eos_token_id
    torch.manual_seed(seed)
    counts = Counter()
    # top_k always explicit: generate's default would be 50, Sampling's 0 means "off"
    given = {} if s is None else {"do_sample": True, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                                  "repetition_penalty": s.repetition_penalty}
    for done in range(0, n, batch):
        prompt = torch.tensor([ids]).expand(min(batch, n - done), -1)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=N_NEW,
                             pad_token_id=model.generation_config.pad_token_id, **given)
        counts.update(outcome(row, eos) for row in out[:, len(ids):].tolist())
    return counts


def exact_outcomes(path, ids, s: Sampling) -> dict[tuple, float]:
    """The probability of every outcome (see ``outcome``) under ``generate(do_sample=True)``: the
    model's next-token logits (float32, as generate casts them) through transformers' own
    repetition penalty (over each prefix's whole sequence, the prompt included), temperature,
    top-k and top-p, in generate's order, expanded over every prefix."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    eos = model.generation_config.eos_token_id
    warpers = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(s.repetition_penalty),
                                   TemperatureLogitsWarper(s.temperature), TopKLogitsWarper(s.top_k),
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


def _speculative_part(target, draft, ids, s: Sampling | None, n: int, first_seed: int, tree_budget: int = 0,
                      in_flight: int = 1):
    """One worker's share of ``speculative_sample`` (a process of its own: it loads its session);
    with ``in_flight`` > 1, every round goes out that many frames ahead of its verdicts."""
    torch.set_num_threads(1)
    link = policy = None
    if in_flight > 1:
        from flight_links import Always, Pipelined

        link, policy = Pipelined(), Always(in_flight)
    session = Head.open(Settings(model=target, draft=draft, k=K, device="cpu", tree_budget=tree_budget,
                                 max_in_flight=in_flight), link=link, policy=policy)
    return speculative_sample(session, ids, s, n, first_seed)


def parallel_speculative_sample(models, ids, s: Sampling | None, n: int, first_seed: int, tree_budget: int = 0,
                                in_flight: int = 1):
    """``speculative_sample`` over two processes when there are two cores: the same seeds, so
    the same outcomes as one process would give."""
    workers = min(2, os.cpu_count() or 1)
    shares = [(first_seed + i * n // workers, (i + 1) * n // workers - i * n // workers) for i in range(workers)]
    counts, histogram = Counter(), np.zeros(wire.MAX_NODES, dtype=int)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = [pool.submit(_speculative_part, str(models["target"]), str(models["draft"]), ids, s, size, seed,
                             tree_budget, in_flight) for seed, size in shares]
        for part in parts:
            c, h = part.result()
            counts.update(c)
            histogram += h
    return counts, histogram
