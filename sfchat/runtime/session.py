"""The head's chat session: tokenizer, chat template, models, link, and the reply loop.

Contract
--------
``ChatSession.load(settings, on_event, link=None)`` resolves devices, dtype and split, loads the
draft and the head slice, connects to the tail (in-process through ``MemoryLink`` unless a
relay link is given) and reports progress as ``LoadProgress`` events. ``reply(prompt_ids, ...)``
is the one reply loop used by the one-shot CLI and the TUI alike: it runs rounds until EOS,
the token budget, the context window or a cancel, and yields ``ReplyStarted``, one
``TokensCommitted`` per round and a final ``ReplyFinished`` with the aggregate figures.
"""

from __future__ import annotations

import secrets
import sys
import time
from typing import Callable, Iterator

import torch

from sfchat import UserError
from sfchat.config import Settings
from sfchat.handshake import Hello
from sfchat.events import LinkState, LoadProgress, ReplyFinished, ReplyStarted, RuntimeReady, TokensCommitted
from sfchat.runtime.draft import Drafter, scratch_slots, tree_shape
from sfchat.runtime.driver import RoundDriver
from sfchat.runtime.links import MemoryLink
from sfchat.runtime.memory import check_head
from sfchat.runtime.policy import Shape, chain_depths, menu
from sfchat.runtime.round import HeadRound
from sfchat.runtime.slices import DTYPE_NAMES, ModelSlice, architecture, n_layers, pick_dtype
from sfchat.runtime.source import ModelSource
from sfchat.runtime.tail import Verifier
from sfchat.wire import Sampling


def resolve_device(name: str | None) -> torch.device:
    if not name or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {name!r} requested but no CUDA GPU is available")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise UserError(f"device {name!r} does not exist ({torch.cuda.device_count()} GPUs visible)")
    elif dev.type != "cpu":
        raise UserError(f"unsupported device {name!r} (use cpu, cuda or cuda:N)")
    return dev


def resolve_devices(name: str | None) -> list[torch.device]:
    """One device, or the GPUs of this node that one slice spreads over ("cuda:0,cuda:1")."""
    devices = [resolve_device(part.strip()) for part in (name or "").split(",")] if name and "," in name \
        else [resolve_device(name)]
    if len(devices) > 1:
        if any(d.type != "cuda" for d in devices):
            raise UserError(f"--device {name!r}: only GPUs can share a slice (for example cuda:0,cuda:1)")
        if len({d.index or 0 for d in devices}) != len(devices):
            raise UserError(f"--device {name!r} names the same GPU twice")
    return devices


def default_draft_device(devices: list[torch.device]) -> torch.device:
    """The draft's device: a GPU the target slice does not use when there is one (a T4 pair)."""
    if devices[0].type != "cuda":
        return devices[0]
    used = {d.index or 0 for d in devices}
    spare = [i for i in range(torch.cuda.device_count()) if i not in used]
    return torch.device("cuda", spare[0]) if spare else devices[-1]


def load_tokenizer(src: ModelSource, revision: str | None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src.tokenizer_location, revision=revision, trust_remote_code=False,
                                             local_files_only=src.local_files_only)
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"cannot load the tokenizer of {src.name!r}: {exc}") from None


def eos_ids(src: ModelSource, tokenizer) -> set[int]:
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        gen = GenerationConfig.from_pretrained(src.tokenizer_location, revision=src.revision,
                                               local_files_only=src.local_files_only)
        eos = gen.eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class TextStream:
    """Incremental detokenisation that never emits half of a multi-byte character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def push(self, ids, final: bool = False) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:  # wait for the rest of the character
            return ""
        delta = text[len(self.text):] if text.startswith(self.text) else text
        self.text = text
        return delta


def make_sampling(temperature: float, top_k: int, top_p: float, seed: int | None) -> Sampling:
    """Sampling settings of one reply; without a seed every reply draws fresh randomness."""
    return Sampling(float(temperature), int(top_k), float(top_p),
                    secrets.randbits(63) if seed is None else int(seed) & (2 ** 64 - 1))


def connect_relay(s: Settings, on_event: Callable = lambda e: None, wait_timeout: float | None = None):
    """The head's relay link once a tail is present (None in local mode), reporting LinkState."""
    if not s.relay:
        on_event(LinkState("local"))
        return None
    from sfchat.relay_link import RelayLink
    from sfchat.pairing import require_secret
    from sfchat.secure_link import secure

    if not s.token:
        raise UserError("--relay needs the relay token: --token T or SFCHAT_TOKEN")
    require_secret(s.secret, s.insecure)
    link = RelayLink(s.relay, s.token, s.session, "head")
    if not link.peer_present:
        on_event(LinkState("waiting", f"waiting for a tail on session {s.session!r}: run "
                                      f"sfchat --tail --relay {s.relay} --session {s.session} with "
                                      f"SFCHAT_TOKEN set{', and use the code it prints' if s.secret else ' and --insecure'}"))
        try:
            link.wait_peer(wait_timeout)
        except BaseException:
            link.close()
            raise
    if s.secret:  # end to end: the relay forwards sealed frames it cannot read or alter
        link = secure(link, s.secret, s.session, "head")
    on_event(LinkState("connected", s.relay if s.secret else f"{s.relay} (unencrypted: --insecure)"))
    return link


def _progress(on_event: Callable, node: str):
    return lambda stage, done, total, detail: on_event(LoadProgress(node, stage, done, total, detail))


def uses_draft(s: Settings) -> bool:
    return bool(s.draft) and s.draft.lower() != "none" and s.depth > 0


def build_engine(s: Settings, on_event: Callable = lambda e: None, link=None,
                 src: ModelSource | None = None, dsrc: ModelSource | None = None):
    """Load draft and head slice, capture graphs, connect to the tail: (RoundDriver, RuntimeReady).

    Token ids only: no tokenizer is needed (benchmarks use random-weight checkpoints)."""
    devices = resolve_devices(s.device)
    device = devices[0]
    draft_device = resolve_device(s.draft_device) if s.draft_device else default_draft_device(devices)
    quant, dquant = ("nf4" if s.load_in_4bit else "none"), ("nf4" if s.draft_load_in_4bit else "none")
    src = src or ModelSource.open(s.model, s.revision, _progress(on_event, "head"))
    L = n_layers(src.config)
    split = L // 2 if s.split is None else s.split
    if not 0 <= split <= L:
        raise UserError(f"--split {split} is out of range: {s.model} has {L} layers (0..{L})")
    dtype = pick_dtype(device, s.dtype)
    limit = getattr(src.config, "max_position_embeddings", None) or s.max_context
    max_context = min(s.max_context, limit)
    k = s.depth if uses_draft(s) else 0
    drafter = None
    if k:
        dsrc = dsrc or ModelSource.open(s.draft, s.draft_revision, _progress(on_event, "draft"))
    asked = s.budget(device.type == "cuda")
    budget = tree_shape(asked, k, dsrc.config.vocab_size)[2] if k and asked else 0
    shapes = menu(k, budget, auto_depth=s.k == "auto", auto_tree=s.tree_budget == "auto")
    # a round writes K+1 positions past the last committed one, or a tree's frame and the draft's frontier
    kv_len = max_context + scratch_slots(k, budget, dsrc.config.vocab_size if k else 1)
    draft_dtype = pick_dtype(draft_device, s.dtype)
    check_head(src.config, split, devices=devices, dtype=dtype, quant=quant, max_len=kv_len, k=k, tree_budget=budget,
               draft=(dsrc.config, draft_device, draft_dtype, dquant) if k else None, local=link is None)
    if k:
        dmodel = ModelSlice.load(dsrc, 0, n_layers(dsrc.config), embed=True, head=True,
                                 dtype=draft_dtype, device=draft_device, max_len=kv_len,
                                 progress=_progress(on_event, "draft"), quant=dquant)
        drafter = Drafter(dmodel, k, tree_budget=budget, depths=chain_depths(shapes))
    head = ModelSlice.load(src, 0, split, embed=True, head=False, dtype=dtype, device=device,
                           max_len=kv_len, progress=_progress(on_event, "head"), quant=quant, devices=devices)
    if s.cuda_graphs and (device.type == "cuda" or draft_device.type == "cuda"):
        capture_graphs(head, drafter, shapes, s.compile_draft, _progress(on_event, "head"))
    mode = "relay" if link is not None else "local"
    if link is None:
        link = MemoryLink(Verifier(device, devices=devices))
    reconnect = (lambda timeout: connect_relay(s, on_event, timeout)) if mode == "relay" else None
    engine = RoundDriver(HeadRound(head, drafter, max_context=max_context, shapes=shapes), link, on_event=on_event,
                         reconnect=reconnect, round_timeout=s.round_timeout, reconnect_timeout=s.reconnect_timeout,
                         max_in_flight=s.max_in_flight)
    hello = Hello(model=s.model, revision=s.revision, split=split, dtype=DTYPE_NAMES[dtype], max_len=kv_len,
                  n_layers=L, hidden_size=src.config.hidden_size, k=k, graphs=s.cuda_graphs, quant=quant,
                  tree_budget=budget, depths=chain_depths(shapes))
    ready = engine.connect(hello, lambda *fields: on_event(LoadProgress("tail", *fields)))
    info = RuntimeReady(model=s.model, draft=s.draft if k else "none", split=split, n_layers=L,
                        dtype=DTYPE_NAMES[dtype], k=k, device=",".join(map(str, devices)), mode=mode,
                        max_context=max_context, quant=quant, tree_budget=budget,
                        shapes=tuple(str(x) for x in shapes), max_in_flight=engine.policy.max_in_flight,
                        tail_dtype="" if ready.dtype == DTYPE_NAMES[dtype] else ready.dtype)
    on_event(info)
    return engine, info


class ChatSession:
    def __init__(self, settings: Settings, tokenizer, engine: RoundDriver, eos: set[int], info: RuntimeReady):
        self.settings, self.tokenizer, self.engine, self.eos, self.info = settings, tokenizer, engine, eos, info

    @classmethod
    def load(cls, s: Settings, on_event: Callable = lambda e: None, link=None) -> "ChatSession":
        src = ModelSource.open(s.model, s.revision, _progress(on_event, "head"))
        architecture(src.config)  # refuse an unsupported model before fetching anything else
        tokenizer = load_tokenizer(src, s.revision)
        dsrc = None
        if uses_draft(s):
            dsrc = ModelSource.open(s.draft, s.draft_revision, _progress(on_event, "draft"))
            check_same_tokenizer(s, tokenizer, load_tokenizer(dsrc, s.draft_revision))
        engine, info = build_engine(s, on_event, link, src, dsrc)
        return cls(s, tokenizer, engine, eos_ids(src, tokenizer), info)

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, messages: list[dict], chat_template: bool = True) -> list[int]:
        """Token ids of a conversation (through the chat template when the tokenizer has one)."""
        tok = self.tokenizer
        if chat_template and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return tok(text, add_special_tokens=False)["input_ids"]
        return tok("".join(m["content"] for m in messages))["input_ids"]

    # -- the reply loop ------------------------------------------------------------------------
    def reply(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling,
              cancelled: Callable[[], bool] = lambda: False) -> Iterator:
        t_start = time.perf_counter()
        reused = self.engine.begin(prompt_ids)
        yield ReplyStarted(len(prompt_ids), reused, len(prompt_ids) - reused)
        stream = TextStream(self.tokenizer)
        hist = [0] * (self.engine.k + 1)
        rounds, tokens, finish = [], [], None
        ttft = 0.0
        while finish is None:
            if cancelled():
                finish = "cancelled"
                break
            out = self.engine.round(sampling, self.eos, max_new_tokens - len(tokens))
            rounds.append(out.stats)
            hist[out.accepted] += 1
            tokens.extend(out.tokens)
            finish = out.finish
            elapsed = time.perf_counter() - t_start
            ttft = ttft or elapsed
            yield TokensCommitted(stream.push(out.tokens, final=finish is not None), out.tokens, out.stats, elapsed)
        total = time.perf_counter() - t_start
        steady = rounds[1:]
        steady_s = sum(r.round_ms for r in steady) / 1e3
        steady_tokens = sum(r.committed for r in steady)
        tps = steady_tokens / steady_s if steady_s > 0 else (len(tokens) / total if total > 0 else 0.0)

        def mean(attr):
            return sum(getattr(r, attr) for r in rounds) / len(rounds) if rounds else 0.0

        hit_rate = sum(r.speculated for r in steady) / len(steady) if steady else 0.0

        yield ReplyFinished(
            finish_reason=finish, text=stream.text, token_ids=tuple(tokens), prompt_tokens=len(prompt_ids),
            rounds=len(rounds), tokens_per_round=len(tokens) / len(rounds) if rounds else 0.0,
            accepted_histogram=tuple(hist), tps=tps, ttft_s=ttft,
            prefill_s=rounds[0].round_ms / 1e3 if rounds else 0.0, round_ms=mean("round_ms"),
            rtt_ms=mean("rtt_ms"), draft_ms=mean("draft_ms"), head_ms=mean("head_ms"), tail_ms=mean("tail_ms"),
            wait_ms=mean("wait_ms"), overlap_ms=mean("overlap_ms"), hit_rate=hit_rate,
            in_flight_mean=mean("in_flight"),
            tree_budget=self.info.tree_budget, depth_mean=mean("depth"), forward_bytes=mean("forward_bytes"),
        )


def capture_graphs(head: ModelSlice, drafter: Drafter | None, shapes: list[Shape], compile_draft: bool,
                   progress) -> None:
    """CUDA graphs for the steady-state round of every shape: the draft's steps (or its tree) and
    the head forward of the verify positions (t0 and the drafts, or the tree's nodes)."""
    def warn(message):
        print(f"sfchat: {message}", file=sys.stderr)

    progress("capture", 0, 2, "head verify")
    for shape in shapes:
        head.capture((shape.budget or shape.depth) + 1, log=warn, tree=bool(shape.budget))
    progress("capture", 1, 2, "draft (compiling: the first start takes a minute)" if compile_draft else "draft")
    if drafter is not None and drafter.device.type == "cuda":
        drafter.capture(log=warn, compile=compile_draft)
    progress("capture", 2, 2, "")


def check_same_tokenizer(s: Settings, target_tok, draft_tok) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise UserError(f"the draft {s.draft!r} uses a different tokenizer than {s.model!r}: "
                        "pick a draft from the same model family, or --draft none")
