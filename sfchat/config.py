"""Settings: command-line flags > environment > TOML file > defaults.

Contract: ``Settings`` is a plain dataclass of everything a run can be configured with.
``RULES`` says what each setting may hold (its type, its range or choices); ``check`` is the one
validation of a value, whatever its source, and a refusal is a ``UserError`` of one line that
names the setting and where it came from (``config file PATH: key ...``, ``--flag ...``,
``SFCHAT_VAR ...``). ``load_file(path)`` reads the TOML config (default: ``config.toml`` in the
platformdirs user config dir) and refuses unknown keys. ``SFCHAT_MODEL``, ``SFCHAT_TOKEN``,
``SFCHAT_RELAY``, ``SFCHAT_SESSION`` and ``SFCHAT_CODE`` (or its older name ``SFCHAT_SECRET``)
fill their settings when the flags do not. The CLI applies flags last (``merged``). What
depends on the model (a split beyond its layers, a context beyond its window) is checked when
it loads. Torch-free.

Models: ``model`` and ``draft`` stay None unless the user chose them (flag, env or file);
``machine_defaults(settings, cuda)`` then fills them for the machine at hand. With a CUDA GPU, or
for a head of two machines (``relay`` or ``direct``: its tail loads the same model id and is the one with the GPU), that is
``GPU_MODEL`` with ``GPU_DRAFT``; in local mode without one it is ``CPU_MODEL``, the small real
model that ``sfchat-model smollm2`` builds into the user cache dir, with ``CPU_DRAFT``.

Sampling: ``temperature``, ``top_k``, ``top_p`` and ``repetition_penalty`` stay None unless the user chose them; the
head then takes the model's own defaults from its ``generation_config.json`` (bounded by the same
``RULES``: ``model.generation``), and without those samples greedily. Their ranges and the seed's
are ``params.BOUNDS``; ``gen_params(settings)`` is the five as one ``params.GenParams``, and
``given_params(settings)`` what a chat screen asks with every prompt (a ``params.Ask``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from sfchat import UserError
from sfchat.link.direct import ADDRESS_SHAPE, DIRECT_ADDRESS, LISTEN_ADDRESS
from sfchat.link.probe import SESSION_NAME
from sfchat.params import BOUNDS, DEFAULT_MAX_NEW_TOKENS, Ask, GenParams
from sfchat.protocol.handshake import MAX_LAYERS
from sfchat.protocol.wire import MAX_NODES

MAX_TREE_BUDGET = MAX_NODES - 1  # a frame holds the root and its drafts: at most MAX_NODES nodes on the wire

APP = "sfchat"
GPU_MODEL, GPU_DRAFT = "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"
CPU_MODEL = "SmolLM2-135M-Instruct"  # built by ``sfchat-model smollm2`` on first use
# Measured on a 2-core CPU (README, "Without a GPU"): SmolLM2 alone is faster than with any draft
# we can make for it, since a draft as large as the target saves nothing and an NF4 copy runs
# slower on a CPU than the dense model does.
CPU_DRAFT = "none"
MAX_K = 32
AUTO_K = 8  # the draft's expansion steps per frame under --k auto (the reference pair's K)
# drafts per frame under --tree-budget auto on a GPU (7 KiB per node at 7B: 448 KiB). With the root a
# frame is 64 rows: bitsandbytes' fused 4-bit GEMM serves 2-64 rows (past 64 it dequantises each NF4
# weight to 16 bits and multiplies), so a 65th row made an NF4 frame ~10 % dearer on an H100 and would
# send most of a 32B layer's linears off the fused kernel on a T4 (bench/RESULTS.md, 2026-12-06).
AUTO_TREE_BUDGET = 63
# rows of every forward of the target under --frame-rows auto on a GPU: the frame's, its prefill's pieces, the
# no-draft step's. A GPU kernel's arithmetic for a row depends on the row count, so one row count for all of
# them makes the reply independent of the frames a network's timing shaped (a CPU's does not depend on it)
AUTO_FRAME_ROWS = 64
MAX_FRAME_ROWS = MAX_NODES  # the frame shape a hello may name
MAX_IN_FLIGHT = 16
MAX_DRAFT_AHEAD = 64
MAX_CONTEXT = 1 << 20  # tokens; the model's own window caps it further
MAX_NEW_TOKENS = 1 << 20


@dataclass
class Settings:
    model: str | None = None  # None: machine_defaults picks GPU_MODEL or CPU_MODEL
    draft: str | None = None  # "none": no speculation; None: the default for the model in use
    revision: str | None = None
    draft_revision: str | None = None
    k: int | str = "auto"  # the draft's expansion steps per frame (a chain frame: K drafts); "auto": AUTO_K
    tree_budget: int | str = "auto"  # drafts per frame, best first over the live tree; 0: chain frames; "auto": AUTO_TREE_BUDGET on a GPU
    frame_rows: int | str = "auto"  # rows of every forward of the target (frames padded, the prefill in pieces); 0: off; "auto": AUTO_FRAME_ROWS on a GPU
    max_in_flight: int = 8  # the most frames in flight under the stream schedule, the policy picks how many and whether to stream (relay mode; 1: one per round trip)
    draft_ahead: int = 0  # draft steps while a verdict travels (relay mode; 0: none: measured to spare a frame no steps)
    split: int | None = None  # default: half the layers
    device: str | None = None  # default: cuda if available, else cpu; "cuda:0,cuda:1" spreads a slice ("cpu,cpu": on the CPU)
    draft_device: str | None = None  # default: a second GPU when there is one, else the head's device
    dtype: str = "auto"
    load_in_4bit: bool = False  # NF4 target slices (head and tail)
    load_in_8bit: bool = False  # int8 target slices (head and tail)
    draft_load_in_4bit: bool = False  # NF4 draft model
    max_context: int = 4096
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float | None = None  # None: the model's own default, else 0 (greedy); see node.head.Head.sampling
    top_k: int | None = None  # None: the model's own default, else 0 (off)
    top_p: float | None = None  # None: the model's own default, else 1 (off)
    repetition_penalty: float | None = None  # None: the model's own default, else 1 (off)
    seed: int | None = None
    system: str | None = None
    chat_template: bool = True
    cuda_graphs: bool = True
    compile_draft: bool = True  # torch.compile the draft before capturing its graph (CUDA only)
    compile_attention: bool = False  # canonical attention's gathers and merge compiled by torch.compile (CUDA only)
    compile_frames: bool = False  # the target's one-shape forwards compiled whole by torch.compile, head's and tail's
    relay: str | None = None
    token: str | None = None
    direct: str | None = None  # head: HOST:PORT of a tail that listens, dialled before the relay
    listen: str | None = None  # tail: HOST:PORT to listen on for a head's direct link (port 0: any free one)
    session: str = "default"
    secret: str | None = None  # the pairing code shared by head and tail (never sent to the relay)
    models_dir: str | None = None  # tail: where a head may name local model directories (os.pathsep-separated)
    insecure: bool = False  # relay mode without end-to-end encryption
    round_timeout: float = 60.0  # seconds without a verdict before the head reconnects
    reconnect_timeout: float = 300.0  # how long the head keeps trying to get a tail back
    history: str | None = None  # SQLite file; default under the platformdirs data dir

    @property
    def depth(self) -> int:
        """The draft's expansion steps per frame: K, or AUTO_K under --k auto."""
        return AUTO_K if self.k == "auto" else self.k

    def quant(self) -> str:
        """How the target's layers are stored: "nf4" (--load-in-4bit), "int8" (--load-in-8bit) or "none"."""
        if self.load_in_4bit and self.load_in_8bit:
            raise UserError("--load-in-4bit and --load-in-8bit exclude each other: choose one")
        return "nf4" if self.load_in_4bit else "int8" if self.load_in_8bit else "none"

    def budget(self, cuda: bool) -> int:
        """Drafts per frame (the frame holds the root too): --tree-budget, or under auto AUTO_TREE_BUDGET on a GPU
        (a tree costs a CPU compute in proportion to its size, so none there)."""
        if self.tree_budget == "auto":
            return AUTO_TREE_BUDGET if cuda else 0
        return self.tree_budget

    def rows(self, cuda: bool, frame: int) -> int:
        """The one row count of every forward of the target (0: none; frames of ``frame`` nodes padded
        to it): --frame-rows, or under auto AUTO_FRAME_ROWS on a GPU (at least a frame), none on a CPU."""
        if self.frame_rows == "auto":
            return max(AUTO_FRAME_ROWS, frame) if cuda else 0
        if self.frame_rows and self.frame_rows < frame:
            raise UserError(f"--frame-rows {self.frame_rows} is below a frame's {frame} nodes: raise it to {frame} "
                            "or more, or lower --tree-budget / --k")
        return self.frame_rows


@dataclass(frozen=True)
class Rule:
    """What one setting may hold: a value of ``kind`` (a float setting takes an integer too); a
    number in ``lo``..``hi`` (``above``: lo itself excluded), finite; "auto" too when ``auto``. A
    string is one non-empty line without control characters, among ``choices`` or matching
    ``pattern`` when given; ``lines``: free text instead, which may be empty and hold line breaks
    and tabs (a system message). ``shape`` words what is wanted where the rest would not."""

    kind: type
    lo: float | None = None
    hi: float | None = None
    above: bool = False
    auto: bool = False
    choices: tuple[str, ...] = ()
    pattern: re.Pattern | None = None
    shape: str = ""
    lines: bool = False

    def wanted(self) -> str:
        """What this setting must be, as the end of "must be ..." in a refusal."""
        if self.shape:
            what = self.shape
        elif self.kind is bool:
            what = "true or false"
        elif self.kind in (int, float):
            lo, hi = (f"{x:g}" if self.kind is float else str(x) for x in (self.lo, self.hi))
            noun = "a whole number" if self.kind is int else "a number"
            what = f"{noun} above {lo} and at most {hi}" if self.above else f"{noun} between {lo} and {hi}"
        elif self.choices:
            what = "one of " + ", ".join(self.choices)
        else:
            what = "text without control characters" if self.lines else "a one-line string without control characters"
        return ("auto or " if self.auto else "") + what

    def check(self, value, from_text: bool = False):
        """``value`` as this setting holds it, or a ValueError saying what it must be.
        ``from_text``: a command-line or environment string, parsed as a number where one is meant."""
        if self.auto and value == "auto":
            return value
        if from_text and type(value) is str and self.kind in (int, float):
            try:
                value = self.kind(value.strip())
            except ValueError:
                pass
        if self.kind is float and type(value) is int:
            value = float(value)
        if type(value) is not self.kind or not self._fits(value):
            shown = repr(value)
            raise ValueError(f"must be {self.wanted()}, not {shown if len(shown) <= 60 else shown[:57] + '...'}")
        return value

    def _fits(self, value) -> bool:
        if self.kind is float and not math.isfinite(value):
            return False
        if self.kind in (int, float):
            return (value > self.lo if self.above else value >= self.lo) and value <= self.hi
        if self.kind is str:
            controls = CONTROL_CHARS_BUT_LINES if self.lines else CONTROL_CHARS
            return (self.lines or value != "") and not controls.search(value) and \
                (not self.choices or value in self.choices) and (self.pattern is None or bool(self.pattern.fullmatch(value)))
        return True


CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
CONTROL_CHARS_BUT_LINES = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
TEXT, FLAG = Rule(str), Rule(bool)
DAY_S = 86400.0
# the server refuses the same ranges per request (sfchat/serve/protocol.py)
RULES: dict[str, Rule] = {
    "model": TEXT, "draft": TEXT, "revision": TEXT, "draft_revision": TEXT,
    "k": Rule(int, 0, MAX_K, auto=True), "tree_budget": Rule(int, 0, MAX_TREE_BUDGET, auto=True),
    "frame_rows": Rule(int, 0, MAX_FRAME_ROWS, auto=True),
    "max_in_flight": Rule(int, 1, MAX_IN_FLIGHT), "draft_ahead": Rule(int, 0, MAX_DRAFT_AHEAD), "split": Rule(int, 0, MAX_LAYERS),
    "device": TEXT, "draft_device": TEXT, "dtype": Rule(str, choices=("auto", "float32", "float16", "bfloat16")),
    "load_in_4bit": FLAG, "load_in_8bit": FLAG, "draft_load_in_4bit": FLAG,
    "max_context": Rule(int, 2, MAX_CONTEXT), "max_new_tokens": Rule(int, 1, MAX_NEW_TOKENS),
    **{name: Rule(b.kind, b.lo, b.hi, above=b.above) for name, b in BOUNDS.items() if name != "seed"},
    "seed": Rule(int, BOUNDS["seed"].lo, BOUNDS["seed"].hi, shape="a whole number of at most 64 bits"),
    "system": Rule(str, lines=True), "chat_template": FLAG, "cuda_graphs": FLAG, "compile_draft": FLAG,
    "compile_attention": FLAG, "compile_frames": FLAG,
    "relay": TEXT, "token": TEXT,
    "direct": Rule(str, pattern=DIRECT_ADDRESS, shape=ADDRESS_SHAPE),
    "listen": Rule(str, pattern=LISTEN_ADDRESS, shape=ADDRESS_SHAPE.replace("(such as", "(port 0: any free one; such as")),
    "session": Rule(str, pattern=SESSION_NAME, shape="1 to 64 characters of A-Z, a-z, 0-9, '.', '_' and '-'"),
    "secret": TEXT, "models_dir": TEXT, "insecure": FLAG,
    "round_timeout": Rule(float, 0, DAY_S, above=True), "reconnect_timeout": Rule(float, 0, DAY_S),
    "history": TEXT,
}
ENV = (("SFCHAT_MODEL", "model"), ("SFCHAT_TOKEN", "token"), ("SFCHAT_RELAY", "relay"),
       ("SFCHAT_SESSION", "session"), ("SFCHAT_SECRET", "secret"), ("SFCHAT_CODE", "secret"))


def check(name: str, value, source: str, from_text: bool = False):
    """``value`` for the setting ``name`` (see ``Rule.check``); ``source`` names where it came
    from and starts the one-line ``UserError`` of a refusal."""
    try:
        return RULES[name].check(value, from_text)
    except ValueError as exc:
        raise UserError(f"{source} {exc}") from None


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
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in RULES:
            raise UserError(f"config file {path}: unknown setting {key!r}")
        setattr(settings, name, check(name, value, f"config file {path}: {key}"))
    return settings


def apply_env(settings: Settings) -> Settings:
    for var, name in ENV:
        if os.environ.get(var):
            setattr(settings, name, check(name, os.environ[var], var, from_text=True))
    return settings


def merged(overrides: dict, path: Path | None = None) -> Settings:
    """File, then environment, then the flags the user actually gave (``overrides``: setting
    name -> value, as argparse parsed it), each value checked where it came from."""
    if path is not None and not path.is_file():
        raise UserError(f"config file {path} does not exist")
    settings = apply_env(load_file(path))
    given = {name: check(name, value, "--" + name.replace("_", "-"), from_text=True)
             for name, value in overrides.items() if name in RULES}
    return dataclasses.replace(settings, **given)


def gen_params(settings: Settings) -> GenParams:
    """The sampling settings the user chose and the seed (None: the head's, else the model's, to fill)."""
    return GenParams(**{name: getattr(settings, name) for name in BOUNDS})


def given_params(settings: Settings) -> Ask:
    """What a chat screen asks with every prompt: the reply limit and ``gen_params``."""
    return Ask(settings.max_new_tokens, gen_params(settings))


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
    if cuda or settings.relay or settings.direct:
        return dataclasses.replace(settings, model=GPU_MODEL,
                                   draft=GPU_DRAFT if settings.draft is None else settings.draft)
    return dataclasses.replace(settings, model=str(cpu_model_dir()),
                               draft=CPU_DRAFT if settings.draft is None else settings.draft)
