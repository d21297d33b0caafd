"""The one-shot CLI as real subprocesses: --json output, greedy parity, the config file, and user errors.

Each ``python -m sfchat.cli`` costs seconds of imports, so the module's runs are all started at
once by one fixture (a few at a time) and every test reads the results it needs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from command_line import cli_env

PROMPT = "hello world, how are you?"
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 4
N_NEW = 12
K_FROM_FILE = 3
JSON_KEYS = {"text", "token_ids", "prompt_tokens", "rounds", "tokens_per_round", "accepted_histogram", "tps",
             "ttft_s", "round_ms", "rtt_ms"}


@pytest.fixture(scope="module")
def runs(zoo, tmp_path_factory):
    """name -> Future of the CompletedProcess of ``python -m sfchat.cli ARGS``."""
    tmp = tmp_path_factory.mktemp("cli")
    config = tmp / "sfchat.toml"  # sets k and max_new_tokens; the runs below override max_new_tokens by flag
    config.write_text(f'k = {K_FROM_FILE}\nmax-new-tokens = 2\ndraft = "{zoo["draft"]}"\n')
    unknown = tmp / "unknown.toml"
    unknown.write_text('k = 2\ncolour = "blue"\n')
    wrong_type = tmp / "wrong-type.toml"
    wrong_type.write_text('k = "three"\n')
    not_a_number = tmp / "nan.toml"
    not_a_number.write_text("temperature = nan\n")

    gpt2 = tmp / "gpt2"  # a valid transformers checkpoint of an architecture sfchat does not run
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=384, n_positions=64, bos_token_id=0, eos_token_id=2)
    GPT2LMHeadModel(cfg).save_pretrained(gpt2)
    AutoTokenizer.from_pretrained(zoo["tokenizer"]).save_pretrained(gpt2)

    target = str(zoo["qwen2-untied"])
    base = ["--model", target, "--device", "cpu"]
    specs = {
        "json": base + ["--config", str(config), "--max-new-tokens", str(N_NEW), "--prompt", PROMPT, "--json"],
        "plain": base + ["--config", str(config), "--max-new-tokens", str(N_NEW), "--prompt", PROMPT],
        "raw": base + ["--draft", "none", "--no-chat-template", "--max-new-tokens", "6", "--prompt", PROMPT,
                       "--json"],
        "missing-model": ["--model", str(tmp / "missing"), "--draft", "none", "--prompt", "hi"],
        "file-model": ["--model", str(zoo["qwen2-untied"] / "config.json"), "--draft", "none", "--prompt", "hi"],
        "default-draft": base + ["--prompt", "hi"],
        "temperature": base + ["--draft", "none", "--temperature", "5", "--prompt", "hi"],
        "nan-config": base + ["--draft", "none", "--config", str(not_a_number), "--prompt", "hi"],
        "unsupported": ["--model", str(gpt2), "--draft", "none", "--device", "cpu", "--prompt", "hi"],
        "foreign-draft": base + ["--draft", str(zoo["foreign-draft"]), "--prompt", "hi"],
        "split": base + ["--draft", "none", "--split", "99", "--prompt", "hi"],
        "too-long": base + ["--draft", "none", "--max-context", "8", "--prompt", LONG_PROMPT],
        "k": base + ["--k", "-1", "--prompt", "hi"],
        "top-p": base + ["--top-p", "0", "--prompt", "hi"],
        "repetition-penalty": base + ["--repetition-penalty", "11", "--prompt", "hi"],
        "cuda": ["--model", target, "--device", "cuda", "--prompt", "hi"],  # before the default draft is looked for
        "tail": ["--tail", "--device", "cpu"],
        "unknown-key": base + ["--config", str(unknown), "--prompt", "hi"],
        "wrong-type": base + ["--config", str(wrong_type), "--prompt", "hi"],
    }
    env = cli_env(tmp)

    def run(args):
        return subprocess.run([sys.executable, "-m", "sfchat.cli", *args], cwd=tmp, env=env, capture_output=True,
                              text=True, timeout=300)

    pool = ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2)))
    futures = {name: pool.submit(run, args) for name, args in specs.items()}
    yield {name: f for name, f in futures.items()}
    pool.shutdown(wait=True)


def result(runs, name) -> subprocess.CompletedProcess:
    return runs[name].result()


def reference(path, ids, n):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def chat_ids(tok, prompt):
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_json_is_one_object_with_the_figures_and_greedy_parity(runs, zoo):
    p = result(runs, "json")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("\n") == 1 and p.stdout.endswith("}\n")
    out = json.loads(p.stdout)  # the whole stdout is one JSON value
    assert isinstance(out, dict) and JSON_KEYS <= out.keys()
    assert "Traceback" not in p.stderr

    tok = AutoTokenizer.from_pretrained(zoo["qwen2-untied"])
    ids = chat_ids(tok, PROMPT)
    ref = reference(zoo["qwen2-untied"], ids, N_NEW)
    assert out["prompt_tokens"] == len(ids)
    assert out["token_ids"] == ref
    assert len(ref) > 2  # the flag's --max-new-tokens won over the file's 2
    assert out["text"] == tok.decode(ref, skip_special_tokens=True)

    assert out["k"] == K_FROM_FILE and out["draft"] == str(zoo["draft"])  # set by the config file
    hist = out["accepted_histogram"]
    assert len(hist) == K_FROM_FILE + 1 and sum(hist) == out["rounds"] >= 1
    assert sum(a * n for a, n in enumerate(hist)) + out["rounds"] >= len(ref)  # each round commits accepted + 1
    assert out["tokens_per_round"] == pytest.approx(len(ref) / out["rounds"])
    for key in ("tps", "ttft_s", "round_ms", "rtt_ms"):
        assert isinstance(out[key], float) and out[key] >= 0, key
    assert out["tps"] > 0 and out["round_ms"] > 0
    assert out["mode"] == "local" and out["device"] == "cpu" and out["split"] == 2


def test_plain_output_is_the_reply_on_stdout_and_stats_on_stderr(runs):
    plain, js = result(runs, "plain"), result(runs, "json")
    assert plain.returncode == 0, plain.stderr
    out = json.loads(js.stdout)
    assert plain.stdout == out["text"] + "\n"
    lines = plain.stderr.splitlines()
    assert len(lines) == 1, plain.stderr
    assert re.fullmatch(rf"\[{len(out['token_ids'])} tokens, {out['rounds']} rounds, [\d.]+ tokens/round, "
                        r"[\d.]+ tok/s, ttft [\d.]+ s\]", lines[0])


def test_no_chat_template_and_no_draft(runs, zoo):
    p = result(runs, "raw")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    tok = AutoTokenizer.from_pretrained(zoo["qwen2-untied"])
    raw = tok(PROMPT)["input_ids"]
    assert out["prompt_tokens"] == len(raw) != len(chat_ids(tok, PROMPT))
    assert out["token_ids"] == reference(zoo["qwen2-untied"], raw, 6)
    assert out["accepted_histogram"] == [out["rounds"]]  # no drafts: one bucket, one token per round
    assert out["rounds"] == len(out["token_ids"]) and out["k"] == 0 and out["draft"] == "none"


@pytest.mark.parametrize("name, message", [
    ("missing-model", r"model directory '.*missing' does not exist"),
    ("file-model", r"'.*config\.json' is a file, not a model: a model is a directory \(config\.json, .*\) or a "
                   r"Hugging Face hub id such as Qwen/Qwen2\.5-1\.5B-Instruct; its directory '.*qwen2-untied' "
                   r"looks like one"),
    ("default-draft", r"the draft Qwen/Qwen2\.5-0\.5B-Instruct, the default when --draft is not given, cannot be "
                      r"used: .* \(--draft none runs without a draft; --draft DIR_OR_HUB_ID picks another\)$"),
    ("temperature", r"--temperature must be a number between 0 and 2, not 5\.0$"),
    ("nan-config", r"config file .*nan\.toml: temperature must be a number between 0 and 2, not nan$"),
    ("unsupported", r"unsupported architecture 'gpt2'"),
    ("foreign-draft", r"the draft '.*foreign-draft' uses a different tokenizer"),
    ("split", r"--split 99 is out of range: .* has 4 layers \(0\.\.4\)"),
    ("too-long", r"the prompt has \d+ tokens, the context window is 8: shorten it or raise --max-context"),
    ("k", r"--k must be auto or a whole number between 0 and 32, not -1"),
    ("top-p", r"--top-p must be a number above 0 and at most 1, not 0\.0"),
    ("repetition-penalty", r"--repetition-penalty must be a number between 0\.01 and 10, not 11\.0"),
    ("cuda", r"device 'cuda' requested but no CUDA GPU is visible.*: use --device cpu, or install the CUDA build "
             r"of torch"),
    ("tail", r"--tail needs --relay"),
    ("unknown-key", r"config file .*unknown\.toml: unknown setting 'colour'"),
    ("wrong-type", r"config file .*wrong-type\.toml: k must be auto or a whole number between 0 and 32, not 'three'"),
])
def test_user_errors_are_one_line_and_exit_2(runs, name, message):
    if name == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = result(runs, name)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("sfchat: error: ")
    assert re.search(message, lines[0]), lines[0]
