"""The head: one interface that every front end (one-shot, the chat UI, the server) opens and asks.

Contract
--------
``open_sources(settings, on_event)`` refuses a device this machine lacks, then opens the target
(refusing an unsupported model before fetching anything else), its tokenizer and the draft's
(which must be the same; a refused default draft is named as the default, with ``--draft none``
as the way out): configs and tokenizers only, so a relay head checks them before it pairs.
``Head.open(settings, on_event, link=None, policy=None, redial=None, sources=None)`` takes those
(``open_sources`` when none are given), then opens the engine (``loading.open_engine``:
draft, head slice, graphs, the tail's handshake). A relay link is dialled by the caller (a
``connect.HeadDialer``, handed in as ``redial`` too, to reconnect with) and handed in; without
one the tail runs in this process; ``policy`` replaces the one that picks frames in flight
(``engine.policy.PipelinePolicy``). ``open`` reports ``LoadProgress``, ``LinkState`` and ``RuntimeReady`` through ``on_event``.

* ``encode(messages)``: a conversation's prompt ids under the one system prompt rule
  (``prompts.with_system``) and the chat template setting.
* ``reply(prompt_ids, max_new_tokens, sampling, cancelled)``: the one reply loop. It runs rounds
  until EOS, the token budget, the context window or ``cancelled()``, and yields ``ReplyStarted``,
  one ``TokensCommitted`` per round and a final ``ReplyFinished`` whose figures come from one
  ``tally.Tally`` of the rounds. The KV cache of a conversation that continues the previous one
  is reused by the engine; nothing is reset between replies.
* ``ask(messages, ...)``: the conversation under the system prompt rule, fitted into the context
  window by the head's one ``window.ContextWindow`` (the oldest turns left out when it is too
  long; ``ReplyStarted.dropped_turns`` says how many), then ``reply``. Used by every front end
  that keeps a conversation (the chat screen, local or remote) and by one-shot; ``--serve``
  encodes and checks its clients' messages itself (``encode``, ``reply``).
* ``sampling(gen)``: a reply's ``Sampling`` from what it asks (a ``params.GenParams``), each value
  None taken from the settings (``config.gen_params``), else from the model's own
  ``generation_config.json`` (``model.generation``, read once at ``open``; ``defaults.notes`` says
  what of it was left out), else ``params.BUILT_IN`` (greedy, a fresh seed for every reply).
* ``watch(timeout)``, between replies: a link to the tail that is gone is reported and dialled
  again (``driver.RoundDriver.watch``).
* ``new_chat()`` forgets the conversation (and what the window left out of it); ``close()`` closes the link.

Single-threaded: the thread that opens a head is the only one to use it (CUDA graph state is
thread-local; see ``worker.CudaThread``).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from sfchat import UserError
from sfchat.config import GPU_DRAFT, Settings, gen_params
from sfchat.events import ReplyFinished, ReplyStarted, RuntimeReady, TokensCommitted
from sfchat.model.generation import Defaults, generation_defaults
from sfchat.model.decoder import architecture
from sfchat.model.source import ModelSource
from sfchat.node.driver import RoundDriver
from sfchat.node.loading import check_devices, check_same_tokenizer, open_engine, progress_events, uses_draft
from sfchat.node.prompts import TextStream, encode, eos_ids, load_tokenizer, make_sampling, with_system
from sfchat.node.window import ContextWindow
from sfchat.params import BUILT_IN, GenParams
from sfchat.protocol.wire import Sampling
from sfchat.tally import Tally


def open_draft(s: Settings, tokenizer, on_event: Callable) -> ModelSource:
    """The draft's source, with the target's tokenizer. A refusal of ``GPU_DRAFT`` says that it is
    the default draft and how to do without it: a user who named only ``--model`` never chose it."""
    try:
        dsrc = ModelSource.open(s.draft, s.draft_revision, progress_events(on_event, "draft"))
        check_same_tokenizer(s, tokenizer, load_tokenizer(dsrc, s.draft_revision))
    except UserError as exc:
        if s.draft != GPU_DRAFT:
            raise
        raise UserError(f"the draft {GPU_DRAFT}, the default when --draft is not given, cannot be used: {exc} "
                        "(--draft none runs without a draft; --draft DIR_OR_HUB_ID picks another)") from None
    return dsrc


def open_sources(s: Settings, on_event: Callable = lambda e: None) -> tuple[ModelSource, object, ModelSource | None]:
    """The target's source, its tokenizer and the draft's source (None without a draft), each
    checked: the devices, the target's architecture, the draft's tokenizer against the target's.
    Cheap (configs and tokenizers, no weights): a relay head runs it before it pairs with a tail,
    so that a model it cannot run is refused before anyone types a code."""
    check_devices(s)
    src = ModelSource.open(s.model, s.revision, progress_events(on_event, "head"))
    architecture(src.config)  # refuse an unsupported model before fetching anything else
    tokenizer = load_tokenizer(src, s.revision)
    return src, tokenizer, open_draft(s, tokenizer, on_event) if uses_draft(s) else None


class Head:
    def __init__(self, settings: Settings, tokenizer, engine: RoundDriver, eos: set[int], info: RuntimeReady,
                 defaults: Defaults = Defaults({})):
        self.settings, self.tokenizer, self.engine, self.eos, self.info = settings, tokenizer, engine, eos, info
        self.defaults = defaults
        self.window = ContextWindow(info.max_context)

    @classmethod
    def open(cls, s: Settings, on_event: Callable = lambda e: None, link=None, policy=None,
             redial: Callable | None = None, sources: tuple | None = None) -> "Head":
        src, tokenizer, dsrc = sources or open_sources(s, on_event)
        engine, info = open_engine(s, on_event, link, src, dsrc, policy, redial)
        return cls(s, tokenizer, engine, eos_ids(src, tokenizer), info, generation_defaults(src))

    def sampling(self, gen: GenParams = GenParams()) -> Sampling:
        """One reply's sampling: each value given, else the setting (a flag, the config file), else
        the model's own default (its generation_config.json), else greedy, top-k, top-p and the
        repetition penalty off; without a seed anywhere, a fresh one."""
        g = gen.over(gen_params(self.settings)).over(self.defaults.values).over(BUILT_IN)
        return make_sampling(g.temperature, g.top_k, g.top_p, g.seed, g.repetition_penalty)

    def encode(self, messages: list[dict]) -> list[int]:
        """Prompt ids of a conversation, under the system prompt rule."""
        return encode(self.tokenizer, with_system(messages, self.settings.system), self.settings.chat_template)

    def ask(self, messages: list[dict], max_new_tokens: int, sampling: Sampling,
            cancelled: Callable[[], bool] = lambda: False) -> Iterator:
        """A reply to a conversation, its oldest turns left out where it is longer than the window."""
        s = self.settings
        fitted = self.window.fit(with_system(messages, s.system), max_new_tokens,
                                 lambda kept: encode(self.tokenizer, kept, s.chat_template))
        return self.reply(fitted.ids, max_new_tokens, sampling, cancelled, fitted.dropped)

    def reply(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling,
              cancelled: Callable[[], bool] = lambda: False, dropped_turns: int = 0) -> Iterator:
        t_start = time.perf_counter()
        reused = self.engine.begin(prompt_ids)
        yield ReplyStarted(len(prompt_ids), reused, len(prompt_ids) - reused, dropped_turns)
        stream = TextStream(self.tokenizer)
        tally = Tally(self.engine.spec.frame_size - 1)  # a verdict commits at most a frame's nodes
        tokens, finish = [], None
        while finish is None:
            if cancelled():
                finish = "cancelled"
                break
            out = self.engine.round(sampling, self.eos, max_new_tokens - len(tokens))
            elapsed = time.perf_counter() - t_start
            tally.add(out.stats, elapsed)
            committed, finish = out.commit.tokens, out.commit.finish
            tokens.extend(committed)
            yield TokensCommitted(stream.push(committed, final=finish is not None), committed, out.stats, elapsed)
        yield ReplyFinished(finish_reason=finish, text=stream.text, token_ids=tuple(tokens),
                            prompt_tokens=len(prompt_ids), tree_budget=self.info.tree_budget, **tally.figures())

    def watch(self, timeout: float) -> None:
        self.engine.watch(timeout)

    def new_chat(self) -> None:
        self.engine.reset()
        self.window.forget()

    def close(self) -> None:
        self.engine.link.close()
