"""The command line's flags: the parser, the settings they give, and flags that would be ignored.

Contract: ``build_parser()`` is ``sfchat``'s argparse parser; every flag defaults to absent
(``argparse.SUPPRESS``), so ``vars(args)`` holds only what the user typed. A parse error is two
lines on stderr, a short usage and ``sfchat: error: ...`` (argparse's own usage line lists every
flag, 18 lines), and exit status 2. ``settings_from(args)`` merges the flags over the TOML file
and the environment (``config.merged``). ``refuse_ignored(args, settings)`` refuses flags the
mode would ignore (model flags or ``--direct`` given to a tail, ``--listen`` to a head) and
names a stale ``SFCHAT_MODEL`` as coming from the environment. Torch-free.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from sfchat import UserError, __version__
from sfchat.config import AUTO_FRAME_ROWS, AUTO_K, AUTO_TREE_BUDGET, CPU_DRAFT, CPU_MODEL, GPU_DRAFT, GPU_MODEL, Settings, merged
from sfchat.plaintext import plain


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """A short usage and the error, not the usage of every flag."""
        self.exit(2, f"usage: {self.prog} [options] ({self.prog} --help lists them)\n"
                     f"{self.prog}: error: {plain(message)}\n")


FLAG_FIELDS = {  # flag dest -> Settings field
    "model": "model", "draft": "draft", "revision": "revision", "draft_revision": "draft_revision",
    "k": "k", "tree_budget": "tree_budget", "frame_rows": "frame_rows", "split": "split", "device": "device", "draft_device": "draft_device", "dtype": "dtype",
    "max_context": "max_context", "max_new_tokens": "max_new_tokens", "temperature": "temperature",
    "top_k": "top_k", "top_p": "top_p", "repetition_penalty": "repetition_penalty", "seed": "seed", "system": "system", "relay": "relay",
    "compile_attention": "compile_attention", "compile_frames": "compile_frames",
    "token": "token", "session": "session", "history": "history", "round_timeout": "round_timeout",
    "reconnect_timeout": "reconnect_timeout", "secret": "secret",
    "load_in_4bit": "load_in_4bit", "load_in_8bit": "load_in_8bit", "models_dir": "models_dir", "draft_load_in_4bit": "draft_load_in_4bit",
    "max_in_flight": "max_in_flight", "draft_ahead": "draft_ahead", "direct": "direct", "listen": "listen",
}


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = Parser(
        prog="sfchat", argument_default=argparse.SUPPRESS,
        description="Chat with one language model split across two machines, with speculative decoding.",
        epilog="Settings may also come from the TOML file (see --config) and SFCHAT_TOKEN / SFCHAT_RELAY / "
               "SFCHAT_SESSION / SFCHAT_CODE; flags win.")
    p.add_argument("--version", action="version", version=f"sfchat {__version__}")
    g = p.add_argument_group("models")
    g.add_argument("--model", help=f"target model: hub id or local directory (or SFCHAT_MODEL; default {GPU_MODEL} "
                                   f"with a CUDA GPU or with --relay, else {CPU_MODEL}, a small model to try sfchat "
                                   "out with, built locally on first use)")
    g.add_argument("--draft", help=f"draft model, or 'none' for no speculation (default {GPU_DRAFT}; "
                                   f"{CPU_DRAFT} with the CPU default model)")
    g.add_argument("--revision", help="hub revision of the target model")
    g.add_argument("--draft-revision", help="hub revision of the draft model")
    g.add_argument("--k", metavar="K|auto",
                   help=f"the draft's expansion steps per frame: how much deeper one frame can reach (a chain of K "
                        f"drafts without a tree); auto (default): {AUTO_K}")
    g.add_argument("--tree-budget", metavar="N|auto",
                   help="drafts per frame, grown best-first over the live speculation tree (0 = a chain of --k "
                        f"drafts); auto (default): {AUTO_TREE_BUDGET} on a GPU, 0 on a CPU")
    g.add_argument("--frame-rows", metavar="N|auto",
                   help="rows of every forward of the target, on head and tail: frames padded to N, the prompt "
                        "in pieces of N, so that a GPU computes the same reply whatever frames the network's timing "
                        f"shaped (0 = off: each forward at its own size); auto (default): {AUTO_FRAME_ROWS} on a GPU, "
                        "0 on a CPU")
    g.add_argument("--split", type=int, help="first layer run by the tail (default: half the layers)")
    g.add_argument("--device", help="cpu, cuda, cuda:N, or cuda:0,cuda:1 to spread the slice over two GPUs "
                                    "(cpu,cpu runs the same two segments on the CPU, to check such a layout's "
                                    "answers; default: cuda when available)")
    g.add_argument("--draft-device", help="device of the draft model (default: a second GPU when two are "
                                          "visible, else --device)")
    g.add_argument("--load-in-4bit", action="store_true",
                   help="NF4 4-bit weights (bitsandbytes) for the target's layers, on head and tail")
    g.add_argument("--load-in-8bit", action="store_true",
                   help="int8 weights (bitsandbytes, LLM.int8() without the outlier split) for the target's "
                        "layers, on head and tail: twice NF4's memory, frames 2.5-3.5x cheaper on a GPU")
    g.add_argument("--draft-load-in-4bit", action="store_true", help="NF4 4-bit weights for the draft model")
    g.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights dtype (default auto: bf16, fp16 on GPUs without bf16, fp32 on CPU)")
    g.add_argument("--no-cuda-graphs", action="store_true",
                   help="run the draft and the verify forwards eagerly (debugging, comparisons)")
    g.add_argument("--no-compile-draft", action="store_true",
                   help="skip torch.compile of the draft model (faster start, slower drafting)")
    g.add_argument("--compile-attention", action="store_true",
                   help="compile canonical attention's gathers and merge with torch.compile on a GPU (one-shape "
                        "forwards: --frame-rows; fewer kernels a layer, a longer start; a head's setting, which its tail follows)")
    g.add_argument("--compile-frames", action="store_true",
                   help="compile the target's whole one-shape forwards (--frame-rows) with torch.compile, "
                        "attention included: faster frames on head and tail, a longer start (a head's setting, "
                        "which its tail follows)")
    g.add_argument("--max-in-flight", type=int, metavar="N",
                   help=f"frames sent over the relay before their verdicts come when the head streams shallow "
                        f"frames (it measures whether that beats one frame per round trip on the link), each "
                        f"hanging in the live tree below the frames before it; the number in use follows the "
                        f"measured link and compute (1 = one frame per round trip always; default {d.max_in_flight})")
    g.add_argument("--draft-ahead", type=int, metavar="N",
                   help=f"draft steps the head may run while a verdict travels over the relay, growing the live "
                        f"tree's likeliest nodes (measured to spare the next frame no steps of its own; 0 = none; "
                        f"default {d.draft_ahead})")
    g.add_argument("--max-context", type=int, help=f"context window in tokens (default {d.max_context})")
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", help="one-shot: answer this prompt and exit")
    g.add_argument("--max-new-tokens", type=int, help=f"reply length limit (default {d.max_new_tokens})")
    g.add_argument("--temperature", type=float, help="0 = greedy (default 0), at most 2")
    g.add_argument("--top-k", type=int, help="sample from the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, help="nucleus sampling threshold (1 = off)")
    g.add_argument("--repetition-penalty", type=float,
                   help="divide a positive logit (multiply a negative one) of every token already in the context by "
                        "this, as transformers' generate() does (1 = off; default: the model's own)")
    g.add_argument("--seed", type=int, help="seed for reproducible sampling")
    g.add_argument("--system", help="system message for the chat template")
    g.add_argument("--no-chat-template", action="store_true", help="use the prompt text as is")
    g.add_argument("--json", action="store_true", help="one-shot: print one JSON object with the reply and figures")
    g = p.add_argument_group("two machines")
    g.add_argument("--relay", help="relay URL, ws://HOST:PORT or wss://... (default: local mode)")
    g.add_argument("--token", help="relay token (or SFCHAT_TOKEN)")
    g.add_argument("--session", help="session name shared by head and tail (default 'default')")
    g.add_argument("--tail", action="store_true", help="run as the tail node (verifier) behind --relay and/or --listen")
    g.add_argument("--listen", metavar="HOST:PORT",
                   help="tail: also take a head's direct link on this address (0.0.0.0:7860; port 0: any free one), "
                        "sealed and paired as through the relay; the port is open to anyone who reaches it")
    g.add_argument("--direct", metavar="HOST:PORT",
                   help="head: dial the tail's --listen address directly, before the relay (with --relay: the "
                        "relay when the direct dial fails within a few seconds)")
    g.add_argument("--secret", help="the pairing code the tail printed (a tail without one makes one); the "
                                    "relay never sees it. Prefer SFCHAT_CODE or the prompt on a terminal: "
                                    "a command line is visible to every user of the machine (ps)")
    g.add_argument("--models-dir", help="tail: local model directories a head may name must lie inside this "
                                        "directory (several: separated by " + repr(os.pathsep) + "); default: "
                                        "hub ids only")
    g.add_argument("--insecure", action="store_true",
                   help="relay mode without end-to-end encryption: the relay can read and alter the chat")
    g.add_argument("--round-timeout", type=float,
                   help="seconds without a verdict before the head reconnects (default 60)")
    g.add_argument("--reconnect-timeout", type=float,
                   help="seconds the head keeps trying to get a tail back before giving up (default 300)")
    g = p.add_argument_group("the chat screen on another machine")
    g.add_argument("--offer-chat", action="store_true",
                   help="head: offer this head's chat screen, through --relay, to one `sfchat --remote` on your own "
                        "machine (a notebook has no terminal); prints a chat code and the command to run there")
    g.add_argument("--chat-session", help="--offer-chat: the relay session of the chat screen (default: --session "
                                          "with -chat added)")
    g.add_argument("--remote", action="store_true",
                   help="only the chat screen, driving a head that runs elsewhere with --offer-chat: needs no torch "
                        "and no model; --relay and --session as that head printed them, its chat code when asked "
                        "(or SFCHAT_CODE)")
    g = p.add_argument_group("OpenAI-compatible server")
    g.add_argument("--serve", action="store_true", help="serve the model over HTTP (OpenAI chat completions API)")
    g.add_argument("--host", help="--serve: address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, help="--serve: port to listen on (default 8000)")
    g.add_argument("--api-key", help="--serve: require Authorization: Bearer KEY; prefer SFCHAT_API_KEY: a command "
                                      "line is visible to every user of the machine (ps)")
    g.add_argument("--max-queue", type=int, help="--serve: requests that may wait for the model; more get 429 "
                                                 "(default 16)")
    g = p.add_argument_group("files")
    g.add_argument("--config", type=Path, help="TOML settings file (default: the platform config dir)")
    g.add_argument("--history", help="chat history SQLite file (default: the platform data dir)")
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    given = {FLAG_FIELDS[k]: v for k, v in vars(args).items() if k in FLAG_FIELDS}
    if getattr(args, "no_chat_template", False):
        given["chat_template"] = False
    if getattr(args, "no_cuda_graphs", False):
        given["cuda_graphs"] = False
    if getattr(args, "no_compile_draft", False):
        given["compile_draft"] = False
    if getattr(args, "insecure", False):
        given["insecure"] = True
    return merged(given, getattr(args, "config", None))


# flags a tail cannot use: the head's hello decides what the tail loads, and the reply is the head's
HEAD_ONLY = ("model", "draft", "revision", "draft_revision", "k", "tree_budget", "frame_rows", "split", "dtype", "load_in_4bit",
             "load_in_8bit",
             "draft_load_in_4bit", "max_context", "draft_device", "max_in_flight", "draft_ahead", "prompt",
             "max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "system", "serve", "offer_chat", "remote")


def refuse_ignored(args: argparse.Namespace, s: Settings) -> None:
    """Inputs that would be ignored are refused, and a setting from the environment is named as such."""
    if getattr(args, "tail", False):
        ignored = [f"--{name.replace('_', '-')}" for name in HEAD_ONLY if name in vars(args)]
        if ignored:
            raise UserError(f"--tail takes no {', '.join(ignored)}: the head tells its tail which model, revision, "
                            "split, dtype and quantisation to load and how to generate; give them to the head")
    if "direct" in vars(args) and getattr(args, "tail", False):
        raise UserError("--direct is the head's (it dials a tail's --listen address); a tail listens with --listen")
    if "listen" in vars(args) and not getattr(args, "tail", False):
        raise UserError("--listen is the tail's (sfchat --tail --listen HOST:PORT); a head dials it with --direct")
    model = os.environ.get("SFCHAT_MODEL")
    if model and "model" not in vars(args) and s.model == model and not getattr(args, "tail", False):
        path = Path(model).expanduser()
        if (model.startswith((".", "/", "~")) or model.count("/") > 1) and not path.exists():
            raise UserError(f"SFCHAT_MODEL={model!r} (set in the environment) names a model directory that does not "
                            "exist: point it at a model, unset it, or give --model")
