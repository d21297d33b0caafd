"""The HELLO/READY handshake as typed messages, checked field by field on arrival.

Contract
--------
``Hello`` is what a head tells its tail (the model, revision, split, dtype, quantisation and
context size to load, ``frames``: the node counts a tree frame is padded to, each verified at
that one shape (the tail captures a verify graph for each), ``one_shape``: every forward of the
tail at the one frame shape, its prefill in pieces of it, padded (``ModelSlice(rows=)``),
whether to capture CUDA graphs, ``compiled_attention``: whether a GPU tail runs canonical
attention compiled, as the head does, so that both halves of a token run one code, and
``compiled_frames``: whether the tail's one-shape forwards are compiled whole, as the head's are
(``ModelSlice(compiled=)``; a ``WireError`` without ``one_shape``)); ``Ready`` is the tail's answer (what
it loaded and computes in). ``to_frame()`` encodes one as a wire Control frame; ``parse(data)``
builds one from a decoded Control's JSON object and raises ``wire.WireError`` (a ``one_shape``
hello with other than one frame shape included) for a missing
field, a value not of its exact JSON type (a bool is no int, a float no int), an integer out of
range or a name of an unknown kind (``fields.json_field``), before anything is allocated or
opened on its word. Both ends are each other's untrusted peers. Torch-free; knows nothing of
models beyond names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sfchat.protocol import wire
from sfchat.protocol.fields import json_field, shown

QUANT_MODES = ("none", "nf4", "int8")  # what a slice may be loaded as (runtime/quant.py implements them)
DTYPE_NAMES = tuple(d.name.lower() for d in wire.DType)
MAX_LAYERS = 1 << 12
MAX_CONTEXT = 1 << 22


MAX_FRAME_SHAPES = 6  # frame sizes a hello may list (each costs the tail a graph per window)


@dataclass(frozen=True)
class Hello:
    model: str
    revision: str | None
    split: int
    dtype: str
    max_len: int
    n_layers: int
    hidden_size: int
    frames: tuple[int, ...] = (1,)  # node counts a tree frame is padded to, ascending
    graphs: bool = True
    quant: str = "none"
    one_shape: bool = False  # every tail forward at the frames' one row count: its prefill's pieces too
    compiled_attention: bool = False  # canonical attention compiled on a GPU tail (the head's --compile-attention)
    compiled_frames: bool = False  # the tail's one-shape forwards compiled whole (the head's --compile-frames)

    def __post_init__(self) -> None:
        object.__setattr__(self, "frames", tuple(self.frames))
        if self.one_shape and len(self.frames) != 1:
            raise wire.WireError(f"one_shape with the frame shapes {list(self.frames)}: it takes exactly one")
        if self.compiled_frames and not self.one_shape:
            raise wire.WireError("compiled_frames without one_shape: only one-shape forwards are compiled whole")

    def shapes(self) -> list[tuple[int, bool]]:
        """(rows, tree) of every verify FORWARD this hello allows: one graph each."""
        return [(n, True) for n in self.frames]

    def shape(self, n: int) -> int | None:
        """The rows a frame of ``n`` nodes is verified at (None: larger than any)."""
        return next((f for f in self.frames if f >= n), None)

    def identity(self) -> tuple:
        """What names the slice a tail loads for this hello (equal identities reuse the slice)."""
        return (self.model, self.revision, self.split, self.dtype, self.max_len, self.quant, self.rows,
                self.compiled_attention, self.compiled_frames)

    @property
    def rows(self) -> int | None:
        """The one row count of every forward of the tail's slice (None: each at its own)."""
        return self.frames[-1] if self.one_shape else None

    def to_frame(self) -> bytes:
        return wire.encode(wire.Control(wire.MsgType.HELLO, asdict(self)))

    @classmethod
    def parse(cls, data: dict) -> "Hello":
        return cls(
            model=json_field(data, "model", str), revision=json_field(data, "revision", (str, type(None))),
            split=json_field(data, "split", int, hi=MAX_LAYERS), dtype=json_field(data, "dtype", str, choices=DTYPE_NAMES),
            max_len=json_field(data, "max_len", int, lo=1, hi=MAX_CONTEXT),
            n_layers=json_field(data, "n_layers", int, lo=1, hi=MAX_LAYERS),
            hidden_size=json_field(data, "hidden_size", int, lo=1, hi=wire.MAX_HIDDEN_SIZE),
            frames=_frames(data), graphs=json_field(data, "graphs", bool, True),
            quant=json_field(data, "quant", str, "none", choices=QUANT_MODES, label="quantisation"),  # a head without 4-bit sends none
            one_shape=json_field(data, "one_shape", bool, False),
            compiled_attention=json_field(data, "compiled_attention", bool, False),  # an older head: plain
            compiled_frames=json_field(data, "compiled_frames", bool, False),
        )


def _frames(data: dict) -> tuple[int, ...]:
    """Frame sizes size the tail's verify graphs: never allocate on a head's word unchecked."""
    value = data.get("frames", [1])
    if type(value) is not list or not 1 <= len(value) <= MAX_FRAME_SHAPES or any(type(n) is not int for n in value):
        raise wire.WireError(f"frames={shown(value)} is not a list of 1 to {MAX_FRAME_SHAPES} integers")
    if any(not 1 <= n <= wire.MAX_NODES for n in value) or value != sorted(set(value)):
        raise wire.WireError(f"frames={shown(value)} must ascend, without repeats, within 1..{wire.MAX_NODES}")
    return tuple(value)


@dataclass(frozen=True)
class Ready:
    n_layers: int
    hidden_size: int
    device: str
    dtype: str  # what the tail computes in (float16 on a GPU without bf16, for a bf16 head)
    load_s: float
    reused: bool  # the tail kept the slice it had loaded for an earlier head

    def to_frame(self) -> bytes:
        return wire.encode(wire.Control(wire.MsgType.READY, asdict(self)))

    @classmethod
    def parse(cls, data: dict) -> "Ready":
        return cls(
            n_layers=json_field(data, "n_layers", int, lo=1, hi=MAX_LAYERS),
            hidden_size=json_field(data, "hidden_size", int, lo=1, hi=wire.MAX_HIDDEN_SIZE),
            device=json_field(data, "device", str), dtype=json_field(data, "dtype", str, choices=DTYPE_NAMES),
            load_s=float(json_field(data, "load_s", (int, float), lo=0, hi=1 << 40)),
            reused=json_field(data, "reused", bool),
        )
