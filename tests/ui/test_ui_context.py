"""A chat longer than the context window, through the chat screen and the real runtime with tiny
models on the CPU: the oldest turns are left out, the system prompt stays, the screen says so, and
every reply is still the target's own greedy continuation of the prompt it was given."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfchat.events import ReplyFinished, RuntimeFailed
from sfchat.node.prompts import encode
from sfchat.params import Ask, GenParams
from sfchat.ui.chat import ChatView, Notice, ReplyMessage

from pilots import chat_app, notices, pilot_test, send, wait_for
from real_worker import RecordingWorker, settings_for

SYSTEM = "be brief"
PROMPTS = ["hello world", "the quick brown fox", "how are you today", "numbers 0 1 2 3", "and then"]
N_NEW = 16


class PromptRecorder(RecordingWorker):
    """The real worker, keeping the conversation each message submitted and the prompt ids the head
    was given for it."""

    def start(self, listener) -> None:
        self.submitted, self.prompts = [], []
        super().start(listener)

    def submit(self, messages, params) -> None:
        self.submitted.append([dict(m) for m in messages])
        super().submit(messages, params)

    def open(self):
        head = super().open()
        reply = head.reply

        def recorded(prompt_ids, *args, **kwargs):
            self.prompts.append(list(prompt_ids))
            return reply(prompt_ids, *args, **kwargs)

        head.reply = recorded
        return head

    def finished(self) -> list[ReplyFinished]:
        return [e for e in self.events if isinstance(e, ReplyFinished)]

    def ended(self) -> list:
        """Replies that finished or failed."""
        return [e for e in self.events if isinstance(e, (ReplyFinished, RuntimeFailed))]


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pilot_test
async def test_a_chat_past_the_context_leaves_out_its_oldest_turns(zoo, tmp_path):
    s = settings_for(zoo, system=SYSTEM, max_context=128)
    worker = PromptRecorder(s)
    ask = Ask(N_NEW, GenParams(temperature=0.0))
    async with chat_app(worker, tmp_path / "h.sqlite3", ask, size=(120, 60), wait=120) as (app, pilot):
        for i, prompt in enumerate(PROMPTS):
            await send(pilot, prompt)
            await wait_for(pilot, lambda: len(worker.ended()) == i + 1 and not app.session.replying, 120)
        await pilot.pause()
        shown = notices(app)
        transcript = list(app.query_one(ChatView).children)
    assert not [e for e in worker.ended() if isinstance(e, RuntimeFailed)]
    started, finished = worker.started(), worker.finished()
    dropped = [e.dropped_turns for e in started]
    assert dropped[0] == 0 and max(dropped) > 0, dropped  # the chat went past the window and on
    assert any(0 < a == b for a, b in zip(dropped, dropped[1:])), dropped  # a start kept, and its K/V reused
    assert len(finished) == len(PROMPTS) and all(f.finish_reason != "context" for f in finished)

    tok = AutoTokenizer.from_pretrained(zoo["llama-tied"])
    target = AutoModelForCausalLM.from_pretrained(zoo["llama-tied"], torch_dtype=torch.float32).eval()
    for i, (messages, n) in enumerate(zip(worker.submitted, dropped)):
        users = [j for j, m in enumerate(messages) if m["role"] == "user"]
        assert messages[-1] == {"role": "user", "content": PROMPTS[i]}
        kept = [{"role": "system", "content": SYSTEM}] + messages[users[n]:]  # the oldest n turns out, whole
        ids = encode(tok, kept)
        assert worker.prompts[i] == ids and len(ids) + N_NEW <= 128
        out = target.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=0)
        assert list(finished[i].token_ids) == out[0, len(ids):].tolist(), f"reply {i}"
        if i:  # K/V reused only where the prompt starts as the cached context did
            cached = worker.prompts[i - 1] + list(finished[i - 1].token_ids)
            assert started[i].reused_tokens <= common(cached, ids)
            if n and n == dropped[i - 1]:  # the same turns left out: the previous prompt is cached whole
                assert started[i].reused_tokens >= len(worker.prompts[i - 1])

    for n in sorted(set(dropped) - {0}):  # one notice per reply that left turns out, above that reply
        assert f"its oldest {n} turns are left out" in shown
    assert shown.count("left out") == sum(1 for n in dropped if n)
    for k, widget in enumerate(transcript):
        if isinstance(widget, Notice) and "left out" in str(widget.render()):
            assert isinstance(transcript[k + 1], ReplyMessage)
