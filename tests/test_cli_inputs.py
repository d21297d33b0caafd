"""Inputs the command line used to ignore or leave unexplained (issue 33, 2.4), as real subprocesses:
a tail given model flags, a stale SFCHAT_MODEL, a one-shot head on a session nobody serves."""

from __future__ import annotations

import subprocess
import sys

from relay_process import TOKEN, start_relay
from command_line import REPO, cli_env


def sfchat(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sfchat.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL)


def test_a_tail_refuses_model_flags_and_says_that_the_head_chooses(tmp_path):
    env = cli_env(tmp_path) | {"SFCHAT_TOKEN": TOKEN}
    done = sfchat("--tail", "--relay", "ws://127.0.0.1:9", "--model", "Qwen/Qwen2.5-7B-Instruct", "--k", "4", env=env)
    assert done.returncode == 2, done.stderr
    assert "--tail takes no --model, --k" in done.stderr and "the head tells its tail" in done.stderr, done.stderr


def test_a_stale_sfchat_model_is_named_as_the_environment_variable(tmp_path):
    env = cli_env(tmp_path) | {"SFCHAT_MODEL": str(tmp_path / "gone" / "model")}
    done = sfchat("--prompt", "hi", "--device", "cpu", env=env)
    assert done.returncode == 2, done.stderr
    assert "SFCHAT_MODEL=" in done.stderr and "set in the environment" in done.stderr, done.stderr
    given = sfchat("--prompt", "hi", "--model", str(tmp_path / "also-gone"), env=env)  # a flag wins, and is named
    assert given.returncode == 2 and "SFCHAT_MODEL" not in given.stderr and "also-gone" in given.stderr, given.stderr


def test_a_one_shot_head_on_a_session_nobody_serves_stops_within_the_reconnect_timeout(zoo, tmp_path):
    with open(tmp_path / "relay.log", "w") as log:
        relay, port = start_relay(log)
    try:
        env = cli_env(tmp_path) | {"SFCHAT_TOKEN": TOKEN, "SFCHAT_CODE": "3-crossover-clockwork"}
        done = sfchat("--prompt", "hi", "--relay", f"ws://127.0.0.1:{port}", "--session", "nobody-here",
                      "--model", str(zoo["qwen2-tied"]), "--draft", "none", "--device", "cpu",
                      "--reconnect-timeout", "1", env=env)
    finally:
        relay.terminate()
        relay.wait(10)
    assert done.returncode == 2, done.stderr
    assert "no tail joined session 'nobody-here'" in done.stderr and "--reconnect-timeout" in done.stderr, done.stderr


def test_a_relay_head_refuses_the_default_draft_of_another_tokenizer_before_it_offers_its_chat(zoo, tmp_path):
    """--model DIR without --draft: the default draft (a Qwen2.5 hub id) cannot serve that model. It
    failed only once the tail was paired, inside the chat screen (the header still "connected"),
    and the screen then exited 0; now it is one error line before any code is printed or asked."""
    with open(tmp_path / "relay.log", "w") as log:
        relay, port = start_relay(log)
    try:
        env = cli_env(tmp_path) | {"SFCHAT_TOKEN": TOKEN, "SFCHAT_CODE": "3-crossover-clockwork"}
        done = sfchat("--offer-chat", "--relay", f"ws://127.0.0.1:{port}", "--session", "mine",
                      "--model", str(zoo["llama-tied"]), "--device", "cpu", env=env, timeout=90)
    finally:
        relay.terminate()
        relay.wait(10)
    assert done.returncode == 2, done.stderr
    assert "chat code" not in done.stderr
    assert done.stderr.splitlines() == [line for line in done.stderr.splitlines() if line.startswith("sfchat: error: ")]
    assert "the draft Qwen/Qwen2.5-0.5B-Instruct, the default when --draft is not given, cannot be used" in \
        done.stderr and "--draft none" in done.stderr, done.stderr


def test_a_mistyped_flag_is_the_error_and_a_short_usage_not_every_flag(tmp_path):
    done = sfchat("--split", "half", env=cli_env(tmp_path))
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["usage: sfchat [options] (sfchat --help lists them)",
                                        "sfchat: error: argument --split: invalid int value: 'half'"]


def test_a_bad_serve_port_blames_the_port_alone(tmp_path):
    done = sfchat("--serve", "--port", "99999", "--device", "cpu", env=cli_env(tmp_path))
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["sfchat: error: --port must be 0..65535, not 99999"]
