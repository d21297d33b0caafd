"""Settings: command-line flags > environment > TOML file > defaults.

Contract: ``Settings`` is a plain dataclass of everything a run can be configured with.
``load_file(path)`` reads the TOML config (default: ``config.toml`` in the platformdirs user
config dir) and rejects unknown keys and wrong types with a ``UserError`` naming the key.
``SFCHAT_MODEL``, ``SFCHAT_TOKEN``, ``SFCHAT_RELAY``, ``SFCHAT_SESSION`` and ``SFCHAT_CODE`` (or
its older name ``SFCHAT_SECRET``) fill their settings when the flags do not. The CLI applies flags
last. Torch-free.

Models: ``model`` and ``draft`` stay None unless the user chose them (flag, env or file);
``machine_defaults(settings, cuda)`` then fills them for the machine at hand. With a CUDA GPU, or
for a relay head (its tail loads the same model id and is the one with the GPU), that is
``GPU_MODEL`` with ``GPU_DRAFT``; in local mode without one it is ``CPU_MODEL``, the small real
model that ``sfchat-model smollm2`` builds into the user cache dir, with ``CPU_DRAFT``.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

import platformdirs

from sfchat import UserError
from sfchat.protocol.wire import MAX_NODES as MAX_TREE_BUDGET

APP = "sfchat"
GPU_MODEL, GPU_DRAFT = "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"
CPU_MODEL = "SmolLM2-135M-Instruct"  # built by ``sfchat-model smollm2`` on first use
# Measured on a 2-core CPU (README, "Without a GPU"): SmolLM2 alone is faster than with any draft
# we can make for it, since a draft as large as the target saves nothing and an NF4 copy runs
# slower on a CPU than the dense model does.
CPU_DRAFT = "none"
MAX_K = 32
AUTO_K = 8  # the deepest --k auto drafts (the reference pair's K)
AUTO_TREE_BUDGET = 64  # the tree --tree-budget auto offers on a GPU (7 KiB per node at 7B: 455 KiB)
MAX_IN_FLIGHT = 16
AUTO_OR_INT = ("k", "tree_budget")  # settings that are "auto" or a number


@dataclass
class Settings:
    model: str | None = None  # None: machine_defaults picks GPU_MODEL or CPU_MODEL
    draft: str | None = None  # "none": no speculation; None: the default for the model in use
    revision: str | None = None
    draft_revision: str | None = None
    k: int | str = "auto"  # drafts per round (the deepest a tree grows); "auto": chosen each round, up to AUTO_K
    tree_budget: int | str = "auto"  # nodes of a token tree; 0: chains only; "auto": AUTO_TREE_BUDGET on a GPU
    max_in_flight: int = 4  # rounds sent before their verdicts come (1: one round per round trip)
    split: int | None = None  # default: half the layers
    device: str | None = None  # default: cuda if available, else cpu; "cuda:0,cuda:1" spreads a slice
    draft_device: str | None = None  # default: a second GPU when there is one, else the head's device
    dtype: str = "auto"
    load_in_4bit: bool = False  # NF4 target slices (head and tail)
    draft_load_in_4bit: bool = False  # NF4 draft model
    max_context: int = 4096
    max_new_tokens: int = 1024
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    system: str | None = None
    chat_template: bool = True
    cuda_graphs: bool = True
    compile_draft: bool = True  # torch.compile the draft before capturing its graph (CUDA only)
    relay: str | None = None
    token: str | None = None
    session: str = "default"
    secret: str | None = None  # the pairing code shared by head and tail (never sent to the relay)
    models_dir: str | None = None  # tail: where a head may name local model directories (os.pathsep-separated)
    insecure: bool = False  # relay mode without end-to-end encryption
    round_timeout: float = 60.0  # seconds without a verdict before the head reconnects
    reconnect_timeout: float = 300.0  # how long the head keeps trying to get a tail back
    history: str | None = None  # SQLite file; default under the platformdirs data dir

    def validate(self) -> "Settings":
        self.k = auto_or_int(self.k, "--k", 0, MAX_K)
        self.tree_budget = auto_or_int(self.tree_budget, "--tree-budget", 0, MAX_TREE_BUDGET)
        if type(self.max_in_flight) is not int or not 1 <= self.max_in_flight <= MAX_IN_FLIGHT:
            raise UserError(f"--max-in-flight must be between 1 and {MAX_IN_FLIGHT}, not {self.max_in_flight!r}")
        if self.max_new_tokens < 1:
            raise UserError("--max-new-tokens must be at least 1")
        if self.max_context < 2:
            raise UserError("--max-context must be at least 2")
        if self.temperature < 0:
            raise UserError("--temperature must be >= 0")
        if self.top_k < 0:
            raise UserError("--top-k must be >= 0 (0 disables it)")
        if self.round_timeout <= 0 or self.reconnect_timeout < 0:
            raise UserError("--round-timeout must be > 0 and --reconnect-timeout >= 0")
        if not 0 < self.top_p <= 1:
            raise UserError("--top-p must be in (0, 1]")
        return self

    @property
    def depth(self) -> int:
        """The deepest a round drafts: K, or AUTO_K under --k auto."""
        return AUTO_K if self.k == "auto" else self.k

    def budget(self, cuda: bool) -> int:
        """Tree nodes a round may verify: --tree-budget, or under auto AUTO_TREE_BUDGET on a GPU
        (a tree costs a CPU compute in proportion to its size, so none there)."""
        if self.tree_budget == "auto":
            return AUTO_TREE_BUDGET if cuda else 0
        return self.tree_budget


def auto_or_int(value, flag: str, lo: int, hi: int) -> int | str:
    """``value`` as "auto" or an integer in lo..hi (a UserError otherwise)."""
    if value == "auto":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if type(value) is not int or not lo <= value <= hi:
        raise UserError(f"{flag} must be auto or a whole number between {lo} and {hi}, not {value!r}")
    return value


def config_path() -> Path:
    return Path(platformdirs.user_config_dir(APP)) / "config.toml"


def history_path() -> Path:
    return Path(platformdirs.user_data_dir(APP)) / "history.sqlite3"


def load_file(path: Path | None = None, settings: Settings | None = None) -> Settings:
    """Settings from the TOML file at ``path`` (missing file: defaults)."""
    settings = settings or Settings()
    path = path or config_path()
    if not path.is_file():
        return settings
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"cannot read config file {path}: {exc}") from None
    known = {f.name: f for f in fields(Settings)}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in known:
            raise UserError(f"config file {path}: unknown setting {key!r}")
        default = getattr(Settings(), name)
        expected = type(default) if default is not None else None
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if expected is None and name in ("model", "draft"):
            expected = str
        if name in AUTO_OR_INT:
            expected = (str, int)
        if name in AUTO_OR_INT and isinstance(value, str) and value != "auto":
            value = None  # refused just below, naming the key
        if expected is not None and (not isinstance(value, expected) or isinstance(value, bool) and expected is not bool):
            kind = "auto or an integer" if name in AUTO_OR_INT else \
                "a " + {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}[expected.__name__]
            raise UserError(f"config file {path}: {key} should be {kind}")
        setattr(settings, name, value)
    return settings


def apply_env(settings: Settings) -> Settings:
    for var, name in (("SFCHAT_MODEL", "model"), ("SFCHAT_TOKEN", "token"), ("SFCHAT_RELAY", "relay"),
                      ("SFCHAT_SESSION", "session"), ("SFCHAT_SECRET", "secret"), ("SFCHAT_CODE", "secret")):
        if os.environ.get(var):
            setattr(settings, name, os.environ[var])
    return settings


def merged(overrides: dict, path: Path | None = None) -> Settings:
    """File, then environment, then the flags the user actually gave (``overrides``)."""
    if path is not None and not path.is_file():
        raise UserError(f"config file {path} does not exist")
    settings = apply_env(load_file(path))
    valid = {f.name for f in fields(Settings)}
    return dataclasses.replace(settings, **{k: v for k, v in overrides.items() if k in valid}).validate()


def cpu_model_dir() -> Path:
    """Where the CPU default model is built on first use (``SFCHAT_CACHE_DIR`` overrides the
    user cache dir, as it does for ``sfchat-model``'s wheel cache)."""
    cache = os.environ.get("SFCHAT_CACHE_DIR") or platformdirs.user_cache_dir(APP)
    return Path(cache) / "models" / CPU_MODEL


def machine_defaults(settings: Settings, cuda: bool) -> Settings:
    """``settings`` with the models the user left unset chosen for this machine (see the module
    docstring). ``model`` becomes ``str(cpu_model_dir())`` for the CPU default: the caller makes
    that directory when it does not exist yet."""
    if settings.model is not None:
        draft = GPU_DRAFT if settings.draft is None else settings.draft
        return dataclasses.replace(settings, draft=draft)
    if cuda or settings.relay:
        return dataclasses.replace(settings, model=GPU_MODEL,
                                   draft=GPU_DRAFT if settings.draft is None else settings.draft)
    return dataclasses.replace(settings, model=str(cpu_model_dir()),
                               draft=CPU_DRAFT if settings.draft is None else settings.draft)
