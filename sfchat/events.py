"""Events that the runtime thread reports to its listener (the TUI or the one-shot CLI).

Contract: small frozen dataclasses of plain Python values, safe to hand from the runtime
thread to any other thread (the TUI forwards them with Textual's thread-safe
``post_message``). This module is torch-free and knows nothing of how the events are made.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LoadProgress:
    """Progress of one loading stage on one node (``node`` is "head" or "tail")."""

    node: str
    stage: str  # "download", "load", "capture", ...
    done: int
    total: int
    detail: str = ""


@dataclass(frozen=True)
class RuntimeReady:
    """Everything is loaded; what is in use."""

    model: str
    draft: str  # "none" when running without speculation
    split: int
    n_layers: int
    dtype: str
    k: int
    device: str
    mode: str  # "local" or "relay"
    max_context: int
    quant: str = "none"  # "nf4" or "int8" when the target's layers are quantised
    tail_dtype: str = ""  # what the tail computes in ("" when it is ``dtype``)
    tree_budget: int = 0  # drafts per frame (--tree-budget); 0: chain frames of K drafts, or no draft
    shapes: tuple[str, ...] = ()  # the one frame shape in use ("chain 8", "tree 64")
    max_in_flight: int = 1  # the most frames in flight (the policy's bound; 1 in local mode)


@dataclass(frozen=True)
class LinkState:
    """State of the head <-> tail link: local, waiting, connected, reconnecting, closed."""

    state: str
    detail: str = ""


@dataclass(frozen=True)
class RoundStats:
    """Figures of one verdict: the frame it answers, and the time since the verdict before."""

    accepted: int  # drafts accepted (0 .. the frame size - 1)
    committed: int  # tokens committed by the verdict (after EOS / limit truncation)
    draft_ms: float
    head_ms: float
    tail_ms: float  # tail compute time, as reported by the tail
    rtt_ms: float  # from sending to the verdict's arrival, less the tail's compute
    round_ms: float
    wait_ms: float = 0.0  # waiting for the verdict (after any frames built under the wait; draft steps ahead included)
    overlap_ms: float = 0.0  # building further frames after this verdict's frame went out
    speculated: bool = False  # this verdict's frame went out while another was in flight, and it committed tokens
    forward_bytes: int = 0  # size of the verify FORWARD frame
    tree_nodes: int = 0  # nodes of the frame, the root counted (a chain's too; 0: no frame could be sent)
    depth: int = 0  # positions the frame spans, from its first node to its deepest
    in_flight: int = 1  # frames sent and not answered when this verdict came
    draft_steps: int = 0  # draft steps of the frames built since the verdict before
    expected: float = 0.0  # the tree's estimate of the tokens the frame would commit (its nodes' values)
    ahead_steps: int = 0  # draft steps run while the verdict travelled (--draft-ahead)
    schedule: str = ""  # the pipeline policy's schedule the frame was built under ("": none)


@dataclass(frozen=True)
class ReplyStarted:
    prompt_tokens: int
    reused_tokens: int  # context tokens whose KV was already held (not prefilled again)
    prefill_tokens: int
    dropped_turns: int = 0  # the conversation's oldest turns left out of the prompt to fit the context window


@dataclass(frozen=True)
class TokensCommitted:
    """New text of the reply (detokenised incrementally) and the round that produced it."""

    text: str
    token_ids: tuple[int, ...]
    stats: RoundStats
    elapsed_s: float  # since the reply was submitted


@dataclass(frozen=True)
class ReplyFinished:
    finish_reason: str  # "eos", "length", "context", "cancelled"
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    rounds: int
    tokens_per_round: float
    accepted_histogram: tuple[int, ...]
    tps: float
    ttft_s: float
    prefill_s: float
    round_ms: float
    rtt_ms: float
    draft_ms: float
    head_ms: float
    tail_ms: float
    wait_ms: float = 0.0
    overlap_ms: float = 0.0
    hit_rate: float = 0.0  # share of verdicts after the first whose frame went out while another was in flight and committed tokens
    in_flight_mean: float = 1.0  # frames in flight when a verdict came, on average
    tree_budget: int = 0  # drafts per frame (0: chain frames)
    depth_mean: float = 0.0  # mean depth the rounds' drafts reached
    forward_bytes: float = 0.0  # mean size of a verify FORWARD

    def figures(self) -> dict:
        """Every figure of the reply as plain JSON values (no text, no token ids): what the
        one-shot ``--json`` prints and the history keeps beside the reply."""
        out = asdict(self)
        del out["text"], out["token_ids"]
        out["tokens"] = len(self.token_ids)
        out["accepted_histogram"] = list(self.accepted_histogram)
        return out


@dataclass(frozen=True)
class CodeWanted:
    """Relay mode: the pairing code is missing or the tail did not take it; the runtime waits for
    ``set_code`` (``reason`` says why, already plain text)."""

    reason: str


@dataclass(frozen=True)
class RuntimeFailed:
    """A fatal or per-request error, already phrased for the user."""

    message: str
    fatal: bool = False


Event = (LoadProgress | RuntimeReady | LinkState | ReplyStarted | TokensCommitted | ReplyFinished | CodeWanted
         | RuntimeFailed)

__all__ = [
    "LoadProgress", "RuntimeReady", "LinkState", "RoundStats", "ReplyStarted", "TokensCommitted",
    "ReplyFinished", "CodeWanted", "RuntimeFailed", "Event",
]
