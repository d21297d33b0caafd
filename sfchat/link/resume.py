"""Where a node keeps the resumption secret of its last code pairing: in memory, or in a private file.

Contract
--------
``Resumption()`` holds the secret (``secret``: 32 bytes, or None before any code pairing);
``keep(secret)`` replaces it. The head keeps it in memory only: a head that restarts has to
type the code again. ``ResumeFile(path, log)`` is the tail's: the secret also lives in ``path``
(created 0600 in a directory created 0700, written to a temporary file in the same directory,
flushed to disk and renamed over the old one, so that a crash leaves the old secret or the new
one, never a mix), and a tail that restarts reads it back, so the head it served pairs again
without a code (``sfchat.link.pairer``). A file that is not a regular file of this user's,
that others may read or write, or that is malformed is not used (``log`` says why); a file
that cannot be written leaves the secret in memory (``log`` says so). What the secret is worth
is in ``sfchat.link.pairing``: it opens resumption pairings of one session's two roles and
nothing else. Torch-free.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable

from sfchat.link.pairing import SECRET_BYTES

MAGIC = b"sfchat-resume/1\n"
FILE_BYTES = len(MAGIC) + 2 * SECRET_BYTES + 1  # the magic, the secret in hex, a newline


class Resumption:
    """The resumption secret of the last code pairing, in memory."""

    def __init__(self, secret: bytes | None = None):
        self.secret = secret

    def keep(self, secret: bytes) -> None:
        self.secret = secret


class ResumeFile(Resumption):
    """The tail's resumption secret, kept in ``path`` across restarts (see the module docstring)."""

    def __init__(self, path: Path, log: Callable[[str], None] = lambda message: None):
        self.path, self.log = Path(path), log
        super().__init__(self._read())

    def _read(self) -> bytes | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.log(f"not using the resumption secret in {self.path}: {exc.strerror or exc}")
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
                self.log(f"not using the resumption secret in {self.path}: it must be a file of yours that "
                         "only you can read (chmod 600); delete it to start afresh")
                return None
            data = os.read(fd, FILE_BYTES + 1)
        finally:
            os.close(fd)
        try:
            if len(data) != FILE_BYTES or not data.startswith(MAGIC) or not data.endswith(b"\n"):
                raise ValueError
            return bytes.fromhex(data[len(MAGIC):-1].decode("ascii"))
        except ValueError:
            self.log(f"not using the resumption secret in {self.path}: the file is malformed")
            return None

    def keep(self, secret: bytes) -> None:
        super().keep(secret)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            temporary.unlink(missing_ok=True)  # left by a crash of an earlier process with this id
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, MAGIC + secret.hex().encode("ascii") + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, self.path)
        except OSError as exc:
            self.log(f"cannot keep the resumption secret in {self.path} ({exc.strerror or exc}): a head "
                     "will need a code again if this tail restarts")
            try:
                temporary.unlink()
            except OSError:
                pass
