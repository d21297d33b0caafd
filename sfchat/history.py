"""Chat history in one SQLite file (stdlib ``sqlite3``, WAL journal).

Contract: ``History`` stores chats and their messages and nothing else; it knows no
tokenizer, model or UI. The thread that opens a ``History`` owns its connection (the TUI's
thread), as sqlite3 connections are not shared across threads here.

Durability: the journal is WAL with ``synchronous=NORMAL``, so a commit survives an
application crash (it is in the WAL file) and at worst the last commits are lost on a power
cut. Callers save a prompt before generation starts and a streaming reply about once a
second, also while no text arrives (its ``updated_at`` is the writer's heartbeat).

Live and dead replies: a streaming row records its writer (process id and host name). When a
``History`` is opened, a streaming row whose writer is gone (no such process on this host, or no
heartbeat for ``STALE_S``) was cut off by a crash and is marked "interrupted" (``recovered``
counts them); a row another running sfchat is still writing is left alone.

Errors: every failure of the database file (damaged, locked by another program for longer than
``LOCK_TIMEOUT_S``, unreadable) is a ``HistoryError``, a ``UserError`` of one line that names the
file and the fix.

A chat may have a system prompt of its own (``chats.system``; NULL: none of its own, the
default applies); ``set_system`` changes it, ``chat_system`` reads it. ``delete_messages`` cuts
messages out of a chat (a regenerated reply, an edited prompt and what followed it).
``list_chats(query=...)`` keeps the chats whose title, system prompt or any message contains the
query (case-insensitive for ASCII letters; per cent, underscore and backslash are taken literally).

Times are Unix seconds (float) as ``time.time()`` gives them.

Privacy: chats are nobody else's business. A new history directory is created 0700, and the
database file (with its WAL and shared-memory files) is made 0600, also when an older sfchat
left it readable by others. None of the three is followed when it is a symbolic link (opened
with ``O_NOFOLLOW``, and SQLite's ``nofollow``): a link planted at the history's path is refused
(a ``HistoryError``), never written through, as the tail's resumption file is.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import sqlite3
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sfchat import UserError

LOCK_TIMEOUT_S = 3.0  # another sfchat holds the write lock for milliseconds; longer is another program
STALE_S = 30.0  # a streaming row not saved for this long has no live writer
STATUSES = ("complete", "streaming", "cancelled", "interrupted")
ROLES = ("user", "assistant", "system")
TITLE_CHARS = 60

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS chats (
    id          INTEGER PRIMARY KEY,
    title       TEXT NOT NULL,
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    model       TEXT NOT NULL DEFAULT '',
    system      TEXT
);
CREATE TABLE IF NOT EXISTS messages (
    id          INTEGER PRIMARY KEY,
    chat_id     INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    seq         INTEGER NOT NULL,
    role        TEXT NOT NULL CHECK (role IN {ROLES!r}),
    content     TEXT NOT NULL,
    status      TEXT NOT NULL CHECK (status IN {STATUSES!r}),
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    stats_json  TEXT,
    writer_pid  INTEGER,
    writer_host TEXT,
    UNIQUE (chat_id, seq)
);
CREATE INDEX IF NOT EXISTS chats_by_update ON chats(updated_at);
"""
_SCHEMA_VERSION = 3  # 2: writer_pid, writer_host; 3: chats.system
QUERY_CHARS = 200  # a search longer than this is cut: no title or message needs more to be found
_HOST = socket.gethostname()


class HistoryError(UserError):
    """The history file cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class ChatSummary:
    """One row of the chat list."""

    id: int
    title: str
    created_at: float
    updated_at: float
    model: str
    n_messages: int


@dataclass(frozen=True)
class Message:
    """One stored message; ``stats`` is the reply's figures (None for prompts)."""

    id: int
    chat_id: int
    seq: int
    role: str
    content: str
    status: str
    created_at: float
    updated_at: float
    stats: dict[str, Any] | None


def default_history_path() -> Path:
    """Where the history lives unless the configuration says otherwise."""
    from platformdirs import user_data_dir

    return Path(user_data_dir("sfchat")) / "history.sqlite3"


def _private_file(path: Path) -> None:
    """Create ``path`` (and its directory) readable by this user only; tighten an existing one.
    A symbolic link or anything but a regular file there (or at its -wal and -shm) is an OSError."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for p, create in ((path, True), (Path(f"{path}-wal"), False), (Path(f"{path}-shm"), False)):
        try:
            fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0), 0o600)
        except FileNotFoundError:
            continue
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(f"{p} is a symbolic link, which sfchat does not follow") from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{p} is not a regular file")
            os.fchmod(fd, 0o600)  # SQLite gives its -wal and -shm files the database file's mode
        finally:
            os.close(fd)


def title_from_prompt(prompt: str) -> str:
    """A chat's title: the first non-blank line of its first prompt, shortened."""
    line = next((s.strip() for s in prompt.splitlines() if s.strip()), "")
    if not line:
        return "(empty prompt)"
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


class History:
    """The chat store. Use it from the thread that created it."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        try:
            if self.path != ":memory:":
                _private_file(Path(path))
            target = self.path if self.path == ":memory:" else f"file:{quote(self.path)}?nofollow=1"
            self._conn = sqlite3.connect(target, timeout=LOCK_TIMEOUT_S, uri=True)
        except (OSError, sqlite3.Error) as exc:
            raise self._error(exc) from None
        self._conn.row_factory = sqlite3.Row
        try:
            self._prepare()
        except HistoryError:
            self._conn.close()
            raise

    def _prepare(self) -> None:
        """Settings, schema (schema 1 gains the writer columns) and the recovery of dead replies."""
        with self._db():
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            with self._conn:
                self._conn.executescript(_SCHEMA)
                columns = {r[1] for r in self._conn.execute("PRAGMA table_info(messages)")}
                for column, kind in (("writer_pid", "INTEGER"), ("writer_host", "TEXT")):
                    if column not in columns:  # a history of schema 1
                        self._conn.execute(f"ALTER TABLE messages ADD COLUMN {column} {kind}")
                if "system" not in {r[1] for r in self._conn.execute("PRAGMA table_info(chats)")}:
                    self._conn.execute("ALTER TABLE chats ADD COLUMN system TEXT")  # schema 1 or 2
                self._conn.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
                dead = [r[0] for r in self._conn.execute(
                    "SELECT id, writer_pid, writer_host, updated_at FROM messages WHERE status='streaming'")
                    if not _writer_lives(r[1], r[2], r[3])]
                self._conn.executemany("UPDATE messages SET status='interrupted' WHERE id=?",
                                       [(i,) for i in dead])
                self.recovered = len(dead)

    @contextmanager
    def _db(self) -> Iterator[None]:
        """Failures of the file itself become one ``HistoryError``; mistakes of the caller stay."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            if not isinstance(exc, sqlite3.OperationalError) and type(exc) is not sqlite3.DatabaseError:
                raise  # a constraint, a closed connection: sfchat's mistake, not the file's
            raise self._error(exc) from None

    def _error(self, exc: Exception) -> HistoryError:
        cause = str(exc) or type(exc).__name__
        if "locked" in cause:
            return HistoryError(f"the chat history {self.path} is locked by another program (for over "
                                f"{LOCK_TIMEOUT_S:.0f} s; another sfchat holds it only for moments): close that "
                                f"program, or start sfchat with --history OTHER_FILE")
        if type(exc) is sqlite3.DatabaseError:  # not a database, malformed image
            return HistoryError(f"the chat history {self.path} is damaged ({cause}): move it aside "
                                f"(mv '{self.path}' '{self.path}.broken') and sfchat starts an empty one, "
                                f"or start sfchat with --history OTHER_FILE")
        return HistoryError(f"the chat history {self.path} cannot be used ({cause}): check the disk and the "
                            f"file's permissions, or start sfchat with --history OTHER_FILE")

    @property
    def journal_mode(self) -> str:
        return self._conn.execute("PRAGMA journal_mode").fetchone()[0]

    def new_chat(self, title: str, model: str = "", system: str | None = None) -> int:
        now = time.time()
        with self._db(), self._conn:
            cur = self._conn.execute(
                "INSERT INTO chats(title, created_at, updated_at, model, system) VALUES (?, ?, ?, ?, ?)",
                (title, now, now, model, system),
            )
        return int(cur.lastrowid)

    def set_system(self, chat_id: int, system: str | None) -> None:
        """The chat's own system prompt (None: none of its own)."""
        with self._db(), self._conn:
            self._conn.execute("UPDATE chats SET system=?, updated_at=? WHERE id=?", (system, time.time(), chat_id))

    def chat_system(self, chat_id: int) -> str | None:
        with self._db():
            row = self._conn.execute("SELECT system FROM chats WHERE id=?", (chat_id,)).fetchone()
        return None if row is None else row[0]

    def delete_messages(self, chat_id: int, msg_ids: list[int]) -> None:
        """Remove these messages of the chat (ids of other chats are left alone)."""
        with self._db(), self._conn:
            self._conn.executemany("DELETE FROM messages WHERE id=? AND chat_id=?", [(i, chat_id) for i in msg_ids])
            self._conn.execute("UPDATE chats SET updated_at=? WHERE id=?", (time.time(), chat_id))

    def add_message(
        self,
        chat_id: int,
        role: str,
        content: str,
        status: str = "complete",
        stats: dict[str, Any] | None = None,
    ) -> int:
        """Append a message to a chat (next ``seq``) and return its id; a streaming one records
        this process as its writer."""
        _check_status(status)
        now = time.time()
        writer = (os.getpid(), _HOST) if status == "streaming" else (None, None)
        with self._db(), self._conn:
            seq = self._conn.execute(
                "SELECT COALESCE(MAX(seq), -1) + 1 FROM messages WHERE chat_id=?", (chat_id,)
            ).fetchone()[0]
            cur = self._conn.execute(
                "INSERT INTO messages(chat_id, seq, role, content, status, created_at, updated_at,"
                " stats_json, writer_pid, writer_host) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (chat_id, seq, role, content, status, now, now, _dump(stats), *writer),
            )
            self._conn.execute("UPDATE chats SET updated_at=? WHERE id=?", (now, chat_id))
        return int(cur.lastrowid)

    def update_message(
        self,
        msg_id: int,
        content: str,
        status: str | None = None,
        stats: dict[str, Any] | None = None,
    ) -> None:
        """Replace a message's content; status and stats change only when given."""
        if status is not None:
            _check_status(status)
        now = time.time()
        with self._db(), self._conn:
            self._conn.execute(
                "UPDATE messages SET content=?, status=COALESCE(?, status),"
                " stats_json=COALESCE(?, stats_json), updated_at=? WHERE id=?",
                (content, status, _dump(stats), now, msg_id),
            )
            self._conn.execute(
                "UPDATE chats SET updated_at=? WHERE id=(SELECT chat_id FROM messages WHERE id=?)",
                (now, msg_id),
            )

    def list_chats(self, limit: int = 200, query: str = "") -> list[ChatSummary]:
        """Chats, most recently updated first; with a ``query``, only those that contain it."""
        where, args = "", ()
        if query.strip():
            pattern = "%" + re.sub(r"([\\%_])", r"\\\1", query.strip()[:QUERY_CHARS]) + "%"
            where = (" WHERE c.title LIKE ? ESCAPE '\\' OR c.system LIKE ? ESCAPE '\\' OR EXISTS"
                     " (SELECT 1 FROM messages m WHERE m.chat_id=c.id AND m.content LIKE ? ESCAPE '\\')")
            args = (pattern, pattern, pattern)
        with self._db():
            rows = self._conn.execute(
                "SELECT c.id, c.title, c.created_at, c.updated_at, c.model,"
                " (SELECT COUNT(*) FROM messages m WHERE m.chat_id=c.id) AS n"
                f" FROM chats c{where} ORDER BY c.updated_at DESC, c.id DESC LIMIT ?",
                (*args, limit),
            ).fetchall()
        return [ChatSummary(r["id"], r["title"], r["created_at"], r["updated_at"], r["model"], r["n"])
                for r in rows]

    def load_chat(self, chat_id: int) -> list[Message]:
        """A chat's messages in conversation order."""
        with self._db():
            rows = self._conn.execute(
                "SELECT * FROM messages WHERE chat_id=? ORDER BY seq", (chat_id,)
            ).fetchall()
        return [
            Message(r["id"], r["chat_id"], r["seq"], r["role"], r["content"], r["status"],
                    r["created_at"], r["updated_at"],
                    json.loads(r["stats_json"]) if r["stats_json"] else None)
            for r in rows
        ]

    def recent_prompts(self, limit: int = 100) -> list[str]:
        """The user's latest prompts across all chats, oldest first (for prompt recall)."""
        with self._db():
            rows = self._conn.execute(
                "SELECT content FROM messages WHERE role='user' ORDER BY created_at DESC, id DESC"
                " LIMIT ?",
                (limit,),
            ).fetchall()
        return [r[0] for r in reversed(rows)]

    def delete_chat(self, chat_id: int) -> None:
        with self._db(), self._conn:
            self._conn.execute("DELETE FROM chats WHERE id=?", (chat_id,))

    def close(self) -> None:
        self._conn.close()


def _writer_lives(pid: int | None, host: str | None, saved_at: float) -> bool:
    """Whether the process that writes a streaming row still runs (rows of schema 1 name none)."""
    if pid is None or time.time() - saved_at > STALE_S:
        return False
    if host != _HOST:
        return True  # another machine sharing the file: its heartbeat is all there is to go by
    if pid == os.getpid():
        return False  # this History has written nothing yet: the pid was a dead process's
    if os.name == "nt":
        return True  # no signal 0 there: the heartbeat alone decides
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a process of another user
    return True


def _check_status(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"unknown message status {status!r}; expected one of {STATUSES}")


def _dump(stats: dict[str, Any] | None) -> str | None:
    return None if stats is None else json.dumps(stats, separators=(",", ":"))
