"""First-run papercuts (issue 33, 2.7): what a new user saw that was jargon, wrapped, or a path."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

from sfchat.config import Settings
from sfchat.history import History
from sfchat.ui.chat import reply_summary
from sfchat.ui.widgets import HeaderBar

from pilots import READY, FakeRuntime, chat_app, open_history, pilot_test, static_text

LOCAL_NO_DRAFT = replace(READY, draft="none", k=0, mode="local", split=15, n_layers=30, dtype="float32")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_first_run_progress_fits_80_columns_and_names_no_temporary_folder(monkeypatch):
    from sfchat.model import convert

    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setenv("COLUMNS", "80")
    show = convert._printer("sfchat: ")
    show("dequantize", 5, 272, "model.layers.12.self_attn.q_proj.weight and more")
    show("write", 0, 1, "/home/me/.cache/sfchat/models/tmpq8x1z0ab/model")
    shown = [part for part in err.getvalue().replace("\n", "\r").split("\r") if part]
    assert shown and all(len(part.removeprefix("\x1b[K")) <= 79 for part in shown), shown
    assert "tmpq8x1z0ab" not in err.getvalue()


def test_help_says_that_relay_mode_changes_the_default_model_and_that_the_cpu_one_is_small():
    from sfchat.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "with a CUDA GPU or with --relay" in text and "a small model to try sfchat out with" in text


def test_the_code_question_is_in_the_screens_words_not_the_command_lines():
    from sfchat.node.connect import HeadDialer

    asked = []

    def ask(reason):
        asked.append(reason)
        raise KeyboardInterrupt  # enough: the question is what this test reads

    with pytest.raises(KeyboardInterrupt):
        HeadDialer(Settings(relay="ws://127.0.0.1:9", token="t"), ask_code=ask)()
    assert asked and "--insecure" not in asked[0] and "SFCHAT_CODE" not in asked[0] and "type it here" in asked[0]


def test_a_reply_without_a_draft_says_no_tokens_per_round():
    alone = {"tokens": 12, "tps": 8.0, "tokens_per_round": 1.0, "accepted_histogram": [12], "finish_reason": "eos"}
    drafted = alone | {"tokens_per_round": 2.5, "accepted_histogram": [1, 2, 3]}
    assert "tok/round" not in reply_summary(alone)
    assert "2.50 tok/round" in reply_summary(drafted)


@pilot_test
async def test_local_mode_without_a_draft_shows_no_split_and_no_k(tmp_path):
    runtime = FakeRuntime(ready=False)
    async with chat_app(runtime, tmp_path / "h.sqlite3", size=(120, 40), ready=False) as (app, pilot):
        app._runtime_ready(LOCAL_NO_DRAFT)
        await pilot.pause()
        header = static_text(app.query_one("#header-info"))
        panel = static_text(app.query_one("#setup"))
    assert "float32" in header and "split" not in header and "K=" not in header, header
    assert "split" not in panel and "K=" not in panel and "weights" in panel, panel


@pilot_test
async def test_the_history_lists_a_model_by_its_name_not_its_path(tmp_path):
    db = tmp_path / "h.sqlite3"
    history = History(db)
    history.add_message(history.new_chat("about paris", "/home/me/.cache/sfchat/models/SmolLM2-135M-Instruct"),
                        "user", "hi")
    history.close()
    async with chat_app(FakeRuntime(), db, size=(120, 40)) as (app, pilot):
        await open_history(pilot)
        await pilot.pause()
        shown = "\n".join(strip.text for strip in app.screen._compositor.render_strips())
    assert "SmolLM2-135M-Instruct" in shown and "/home/me" not in shown, shown
    assert HeaderBar  # the header's own test is above


def test_the_loading_header_names_the_model_as_the_ready_header_does(monkeypatch, tmp_path):
    """The loading header showed the CPU default model's whole cache path; the ready one, its name."""
    import sfchat.ui
    from sfchat import tui

    titles = []
    monkeypatch.setattr(sfchat.ui, "run_tui", lambda runtime, path, params, title, system: titles.append(title))
    model = str(tmp_path / "cache" / "sfchat" / "models" / "SmolLM2-135M-Instruct")
    assert tui.chat(Settings(model=model, history=str(tmp_path / "history.sqlite3"))) == 0
    assert titles == ["sfchat — SmolLM2-135M-Instruct (local) — loading…"]
