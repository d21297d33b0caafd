"""The remote chat screen in a process where torch (and nothing of the ``[model]`` extra) can be imported, driving a real head (the
runtime thread with tiny models on the CPU) through a real relay: what a laptop without torch does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

from relay_process import REPO, TOKEN, start_relay

from sfchat.config import Settings
from sfchat.link.pairing import Passcode
from sfchat.link.relay import RelayLink
from sfchat.link.resume import Resumption
from sfchat.link.secure import SecureLink
from sfchat.node.worker import RuntimeWorker
from sfchat.protocol.chat_events import reply_text
from sfchat.remote.host import ChatHost

from real_worker import one_shot_text

SESSION = "remote-real"
CODE = "5-crossover-clockwork"
PROMPT = "hello world"
N = 16

NO_TORCH = textwrap.dedent("""
    import importlib.abc, sys

    MODEL_EXTRA = ("torch", "transformers", "tokenizers", "safetensors", "huggingface_hub", "numpy", "tqdm",
                   "bitsandbytes", "starlette", "uvicorn", "prometheus_client", "gguf")  # pyproject's [model]

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in MODEL_EXTRA:
                raise ImportError(name + " is not installed on this machine (no [model] extra)")

    sys.meta_path.insert(0, NoTorch())
""")

SCREEN = NO_TORCH + textwrap.dedent("""
    import asyncio, io, json, contextlib
    sys.path.insert(0, {tests!r})
    import sfchat.cli, sfchat.remote.cli  # the command line's whole path to the screen
    from sfchat.link.relay import RelayLink
    from sfchat.params import Ask, GenParams
    from sfchat.remote.client import RemoteRuntime
    from sfchat.ui import SfchatApp
    from sfchat.ui.chat import ReplyMessage
    from pilots import send, wait_for

    async def main():
        runtime = RemoteRuntime(lambda: RelayLink({url!r}, {token!r}, {session!r}, "head"), {code!r}, {session!r})
        app = SfchatApp(runtime, ":memory:", Ask({n}, GenParams(temperature=0.0)))
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.ready is not None, 120)
            await send(pilot, {prompt!r})
            await wait_for(pilot, lambda: not app.session.replying and app.session.turns, 120)
            await pilot.pause()
            return app.query_one(ReplyMessage).markdown.source, app.meter.figures().tokens_per_round

    text, per_round = asyncio.run(main())
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # the command itself, up to where it wants a terminal
        rc = sfchat.cli.main(["--remote", "--relay", {url!r}, "--session", {session!r}])
    try:
        import torch  # noqa: F401
        blocked = False
    except ImportError:
        blocked = True
    print(json.dumps({{"blocked": blocked, "text": text, "per_round": per_round, "rc": rc, "said": err.getvalue(),
                       "torch": "torch" in sys.modules}}))
""")


def test_the_remote_screen_needs_no_torch_and_shows_the_real_heads_reply(zoo, tmp_path):
    model = str(zoo["qwen2-tied"])  # its own draft: every draft accepted
    settings = Settings(model=model, draft=model, k=3, device="cpu")
    expected = one_shot_text(settings, PROMPT, N)
    with open(tmp_path / "relay.log", "w") as log:
        relay, port = start_relay(log)
    url = f"ws://127.0.0.1:{port}"
    passcode, kept, said = Passcode(CODE), Resumption(), []
    worker = RuntimeWorker(settings)
    host = ChatHost(worker, lambda: SecureLink(RelayLink(url, TOKEN, SESSION, "tail"), passcode, SESSION, "tail",
                                               resumption=kept), said.append)
    serving = threading.Thread(target=host.serve, daemon=True)
    serving.start()
    try:
        script = SCREEN.format(tests=os.path.dirname(__file__), url=url, token=TOKEN, session=SESSION, code=CODE,
                               n=N, prompt=PROMPT)
        env = dict(os.environ, SFCHAT_TOKEN=TOKEN, PYTHONPATH=str(REPO))
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                              stdin=subprocess.DEVNULL)
    finally:
        host.close()
        serving.join(30)
        worker.join(30)
        relay.terminate()
        relay.wait(10)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["blocked"] and out["torch"] is False  # torch could not be imported there, and nothing had
    assert out["text"] == reply_text(expected)  # the random model's reply, its control characters taken out
    assert out["per_round"] and out["per_round"] > 1  # the head's figures: its draft was accepted
    assert out["rc"] == 2 and "needs a terminal" in out["said"], out  # the command got that far without torch
    assert "a chat client attached" in said
