"""The SQLite chat history and the session that writes to it."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import pytest

from sfchat.events import ReplyFinished
from sfchat.history import History, HistoryError, default_history_path, title_from_prompt
from sfchat.ui.session import SAVE_INTERVAL_S, ChatSession


def finished(text: str, reason: str = "eos") -> ReplyFinished:
    return ReplyFinished(reason, text, (1, 2, 3), 10, 2, 1.5, (1, 1), 9.0, 0.2, 0.1,
                         100.0, 80.0, 5.0, 3.0, 4.0)


def other_connection(path) -> sqlite3.Connection:
    """A second reader, as another process would see the file."""
    return sqlite3.connect(path)


def test_wal_mode_and_schema(tmp_path):
    path = tmp_path / "sub" / "h.sqlite3"  # parent folders are created
    history = History(path)
    assert history.journal_mode == "wal"
    assert history._conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    assert history._conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    cols = {r[1] for r in history._conn.execute("PRAGMA table_info(messages)")}
    assert cols == {"id", "chat_id", "seq", "role", "content", "status", "created_at",
                    "updated_at", "stats_json", "writer_pid", "writer_host"}
    history.close()


def test_default_path_and_titles():
    assert default_history_path().name == "history.sqlite3"
    assert title_from_prompt("\n  first line \nsecond") == "first line"
    long = title_from_prompt("word " * 40)
    assert len(long) <= 60 and long.endswith("…")
    assert title_from_prompt("   ") == "(empty prompt)"


def test_list_and_load_order(tmp_path):
    history = History(tmp_path / "h.sqlite3")
    a = history.new_chat("a", "m")
    b = history.new_chat("b", "m")
    for i in range(3):
        history.add_message(a, "user" if i % 2 == 0 else "assistant", f"a{i}")
    history.add_message(b, "user", "b0")
    assert [c.title for c in history.list_chats()] == ["b", "a"]
    history.add_message(a, "assistant", "a3")  # a is now the most recently updated
    chats = history.list_chats()
    assert [(c.title, c.n_messages) for c in chats] == [("a", 4), ("b", 1)]
    msgs = history.load_chat(a)
    assert [m.seq for m in msgs] == [0, 1, 2, 3]
    assert [m.content for m in msgs] == ["a0", "a1", "a2", "a3"]
    assert history.recent_prompts() == ["a0", "a2", "b0"]
    history.delete_chat(b)
    assert [c.title for c in history.list_chats()] == ["a"]
    assert history.list_chats(limit=0) == []
    with pytest.raises(ValueError):
        history.add_message(a, "user", "x", status="bogus")
    history.close()


def test_session_writes_prompt_first_and_reply_while_streaming(tmp_path):
    path = tmp_path / "h.sqlite3"
    now = [100.0]
    session = ChatSession(History(path), model="m", clock=lambda: now[0])
    reader = other_connection(path)

    def rows():
        return reader.execute("SELECT role, content, status FROM messages ORDER BY seq").fetchall()

    messages = session.send("Hello?\nmore")
    assert messages == [{"role": "user", "content": "Hello?\nmore"}]
    assert rows() == [("user", "Hello?\nmore", "complete")]  # stored before generation
    assert reader.execute("SELECT title, model FROM chats").fetchall() == [("Hello?", "m")]

    session.reply_started()
    assert rows()[1] == ("assistant", "", "streaming")
    session.reply_text("Hi")
    assert rows()[1] == ("assistant", "", "streaming")  # throttled: not yet a second old
    now[0] += SAVE_INTERVAL_S
    session.reply_text(" there")
    assert rows()[1] == ("assistant", "Hi there", "streaming")
    session.reply_text(" friend")
    turn = session.reply_finished(finished("Hi there friend"))
    assert turn.status == "complete"
    assert rows()[1] == ("assistant", "Hi there friend", "complete")
    stats = session.history.load_chat(session.chat_id)[1].stats
    assert stats["finish_reason"] == "eos" and stats["tokens"] == 3

    # The next prompt continues the same chat with the whole conversation.
    assert session.send("And?") == [
        {"role": "user", "content": "Hello?\nmore"},
        {"role": "assistant", "content": "Hi there friend"},
        {"role": "user", "content": "And?"},
    ]
    session.reply_started()
    session.reply_finished(finished("Partial", "cancelled"))
    assert rows()[-1] == ("assistant", "Partial", "cancelled")
    assert reader.execute("SELECT COUNT(*) FROM chats").fetchone()[0] == 1
    reader.close()
    session.history.close()


def test_crash_while_streaming_is_recovered_as_interrupted(tmp_path):
    path = tmp_path / "h.sqlite3"
    now = [0.0]
    session = ChatSession(History(path), clock=lambda: now[0])
    session.send("q")
    session.reply_started()
    session.reply_text("half")
    now[0] += 5
    session.reply_text(" done")
    # The process dies here: no finish, no close.
    del session

    reopened = History(path)
    assert reopened.recovered == 1
    chat = reopened.list_chats()[0]
    reply = reopened.load_chat(chat.id)[1]
    assert (reply.status, reply.content) == ("interrupted", "half done")
    assert History(path).recovered == 0  # recovery happens once
    resumed = ChatSession(reopened)
    resumed.open(chat.id, chat.title)
    assert resumed.send("again")[1] == {"role": "assistant", "content": "half done"}
    reopened.close()


def test_failure_before_any_text_leaves_no_empty_reply(tmp_path):
    session = ChatSession(History(tmp_path / "h.sqlite3"))
    session.send("q")
    assert session.reply_failed().status == "interrupted"
    assert not session.replying
    assert [m.role for m in session.history.load_chat(session.chat_id)] == ["user"]
    session.history.close()


def test_the_history_is_private_to_its_user(tmp_path):
    """Today's finding: the database was created 0644 (and its directory 0755) under the usual umask."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        path = tmp_path / "data" / "sfchat" / "history.sqlite3"
        h = History(path)
        h.add_message(h.new_chat("t"), "user", "a private prompt")
        mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
        assert mode(path.parent) == 0o700
        assert [mode(p) for p in (path, f"{path}-wal", f"{path}-shm")] == [0o600] * 3
        h.close()
        older = tmp_path / "older.sqlite3"  # left readable by an older sfchat
        older.touch(mode=0o644)
        os.chmod(older, 0o644)
        History(older)
        assert mode(older) == 0o600
    finally:
        os.umask(old)


def test_a_damaged_history_is_one_line_naming_the_file_and_the_fix(tmp_path):
    """Today's finding: "internal error: DatabaseError" and nothing about which file or what to do."""
    from sfchat import UserError

    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"this is not an SQLite database " * 200)
    with pytest.raises(UserError) as caught:
        History(junk)
    message = str(caught.value)
    assert f"the chat history {junk} is damaged (file is not a database)" in message
    assert f"mv '{junk}' '{junk}.broken'" in message and "--history" in message and "\n" not in message

    torn = tmp_path / "torn.sqlite3"  # a real history whose pages were overwritten
    h = History(torn)
    chat = h.new_chat("t")
    for i in range(300):
        h.add_message(chat, "user", f"prompt {i} " * 20)
    h._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    h.close()
    data = bytearray(torn.read_bytes())
    data[4096:len(data) - 4096] = b"\xff" * (len(data) - 8192)
    torn.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"is damaged \(database disk image is malformed\): move it aside"):
        History(torn).load_chat(chat)


def test_a_locked_history_says_so_within_seconds(tmp_path):
    """Today's finding: "database is locked", as an internal error, after 10 s. Now SQLite waits
    ``LOCK_TIMEOUT_S`` for the lock (its own timeout, not a clock of the test's)."""
    from sfchat import UserError
    from sfchat.history import LOCK_TIMEOUT_S

    assert LOCK_TIMEOUT_S <= 5

    path = tmp_path / "h.sqlite3"
    History(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another program writing, and not letting go
    with pytest.raises(UserError, match=rf"the chat history {path} is locked by another program .*--history"):
        History(path)
    holder.execute("ROLLBACK")
    History(path).close()  # free again: it opens
    holder.close()


WRITER = """
import sys, time
sys.path.insert(0, {root!r})
from sfchat.history import History
from sfchat.ui.session import ChatSession
session = ChatSession(History({path!r}))
session.send("question")
session.reply_started()
session.reply_text("half an answer")
print("STREAMING", flush=True)
while True:  # a long prefill, a tail reconnecting: no text comes, the heartbeat goes on
    time.sleep(0.1)
    session.heartbeat()
"""


def test_a_reply_another_sfchat_is_writing_is_left_alone_until_its_writer_dies(tmp_path):
    """Today's finding: a second sfchat on the same history marked the first's live reply interrupted."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    path = tmp_path / "h.sqlite3"
    script = WRITER.format(root=str(Path(__file__).parents[1]), path=str(path))
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "STREAMING"
        second = History(path)
        assert second.recovered == 0
        chat = second.list_chats()[0].id
        reply = second.load_chat(chat)[1]
        assert reply.status == "streaming"
        time.sleep(1.5)
        later = second.load_chat(chat)[1]  # the writer's heartbeat, which saves the text too
        assert later.updated_at > reply.updated_at and later.content == "half an answer"
        assert History(path).recovered == 0  # still alive: still left alone
        second.close()
    finally:
        writer.kill()
        writer.wait(10)
    third = History(path)  # the writer is gone: its reply was cut off
    assert third.recovered == 1
    assert third.load_chat(chat)[1].status == "interrupted"
    third.close()


@pytest.mark.parametrize("writer, age_s, lives", [
    ("parent", 1.0, True),  # a live process on this host, saving
    ("parent", 60.0, False),  # alive, but silent for longer than STALE_S: not a writer any more
    ("gone", 1.0, False),  # no such process
    ("other host", 1.0, True),  # another machine sharing the file: its heartbeat decides
    ("other host", 60.0, False),
    ("none", 1.0, False),  # a row of schema 1, which names no writer
])
def test_who_writes_a_streaming_row_decides_whether_it_is_dead(tmp_path, writer, age_s, lives):
    import os
    import socket
    import time

    from sfchat.history import STALE_S

    assert STALE_S < 60.0
    path = tmp_path / "h.sqlite3"
    h = History(path)
    msg = h.add_message(h.new_chat("t"), "assistant", "partial", status="streaming")
    gone = max(int(open("/proc/sys/kernel/pid_max").read()) - 1, os.getpid() + 1)
    pid, host = {"parent": (os.getppid(), socket.gethostname()), "gone": (gone, socket.gethostname()),
                 "other host": (os.getppid(), "elsewhere"), "none": (None, None)}[writer]
    h._conn.execute("UPDATE messages SET writer_pid=?, writer_host=?, updated_at=? WHERE id=?",
                    (pid, host, time.time() - age_s, msg))
    h._conn.commit()
    h.close()
    reopened = History(path)
    assert reopened.recovered == (0 if lives else 1)
    assert reopened.load_chat(1)[0].status == ("streaming" if lives else "interrupted")
    reopened.close()


def test_a_history_of_schema_1_gains_the_writer_and_system_columns_and_recovers_its_rows(tmp_path):
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE chats (id INTEGER PRIMARY KEY, title TEXT NOT NULL, created_at REAL NOT NULL,
                            updated_at REAL NOT NULL, model TEXT NOT NULL DEFAULT '');
        CREATE TABLE messages (id INTEGER PRIMARY KEY, chat_id INTEGER NOT NULL REFERENCES chats(id)
                               ON DELETE CASCADE, seq INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL,
                               status TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL,
                               stats_json TEXT, UNIQUE (chat_id, seq));
        INSERT INTO chats VALUES (1, 'old chat', 1, 1, 'm');
        INSERT INTO messages VALUES (1, 1, 0, 'user', 'q', 'complete', 1, 1, NULL);
        INSERT INTO messages VALUES (2, 1, 1, 'assistant', 'cut', 'streaming', 1, 1, NULL);
        PRAGMA user_version=1;
    """)
    old.close()
    h = History(path)
    assert h.recovered == 1
    assert [(m.content, m.status) for m in h.load_chat(1)] == [("q", "complete"), ("cut", "interrupted")]
    assert h._conn.execute("PRAGMA user_version").fetchone()[0] == 3
    assert h.chat_system(1) is None  # the chat gained a system prompt column, empty
    h.set_system(1, "be brief")
    assert h.chat_system(1) == "be brief"
    h.add_message(1, "assistant", "new", status="streaming")
    h.close()


@pytest.mark.parametrize("linked", ["", "-wal"])
def test_a_symbolic_link_at_the_history_path_is_refused_not_followed(tmp_path, linked):
    """Round four: --history followed symlinks (the resumption file is opened with no-follow)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file\n")
    os.chmod(victim, 0o644)
    path = tmp_path / "chats" / "history.sqlite3"
    path.parent.mkdir()
    if linked:
        History(path).close()
    Path(f"{path}{linked}").symlink_to(victim)
    with pytest.raises(HistoryError, match="symbolic link"):
        History(path)
    assert victim.read_text() == "someone else's file\n" and stat.S_IMODE(os.stat(victim).st_mode) == 0o644


def test_list_chats_with_a_query_keeps_the_chats_that_contain_it(tmp_path):
    history = History(tmp_path / "h.sqlite3")
    a, b, c = (history.new_chat(t) for t in ("Pasta tonight", "trip", "50% off"))
    history.add_message(b, "assistant", "Take the night train")
    history.add_message(c, "user", "a_b and c\\d")
    history.set_system(a, "You are a chef.")

    def found(query: str) -> list[str]:
        return [s.title for s in history.list_chats(query=query)]

    assert found("") == found("   ") == ["Pasta tonight", "50% off", "trip"]  # the latest change first
    assert found("TRAIN") == ["trip"] and found("pasta") == ["Pasta tonight"] and found("chef") == ["Pasta tonight"]
    assert found("%") == ["50% off"] and found("a_b") == ["50% off"] and found("_") == ["50% off"]
    assert found("c\\d") == ["50% off"] and found("nothing like it") == []
    history.close()
