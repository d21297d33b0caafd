"""The draft model: it proposes the continuations of the speculation tree's nodes.

Contract
--------
``Drafter(model, width, children, pool, blocks_from, fuse)`` keeps the draft's KV cache in step with
the committed context (``sync``: whatever prefix of the context is cached is reused, the rest is
fed in chunks) and, right after it, ``scratch``: an ``engine.scratch.Scratch`` of ``pool`` slots
for the live nodes it has run on (whoever builds the rows takes, releases and commits them there).
``expand(rows, s)`` runs one forward padded to ``rows`` = ``width + 1`` rows (the committed
nodes it has not run yet first, the catch-up after a verdict, then up to ``width`` nodes to
expand; a padding row writes the scratch's trash slot and sees only it): each row a node
(token, position, the node, its ancestors in the scratch), written at its slot with the tree
mask (it sees the context, its ancestors and itself; over a window of ``blocks_from`` slots or
more, ``BLOCKS_FROM`` by default, its attention runs in blocks of ``BLOCK`` side by side,
``kv.StaticKV.in_blocks``), and returns each row's ``children`` likeliest continuations with
their probabilities (of the raw distribution when greedy, of the warped one when sampling: the
draft never samples; the target's draw at each node decides, see ``sampling.picks``). One host
sync per call. With ``fuse`` (the default) it first merges the draft's q/k/v and gate/up
projections into one GEMM each (``ModelSlice.fuse_projections``; a quantized draft's layers stay
as they are).

Graphs and the CPU run the same code: the forward is a plain function of tensors (``_expand``)
that ``model.graphs.GraphTable`` replays from a graph captured over it, one per attention window,
or calls. A sampled expansion is the same graph with the sampling settings (``sampling.Knobs``)
as inputs. The drafter knows nothing of the target, the wire or acceptance.
"""

from __future__ import annotations

import torch

from sfchat.engine import sampling
from sfchat.engine.scratch import Scratch
from sfchat.model.attention import allow_recompiles
from sfchat.model.graphs import GraphTable
from sfchat.model import kv
from sfchat.model.kv import PREFILL_CHUNK, TreeMask
from sfchat.model.slices import ModelSlice
from sfchat.protocol.wire import Sampling

# nodes the draft expands per step. On a GPU a 0.5B draft's step of 33 rows costs what one of 9
# does (H200: 4.1 against 4.0 ms, bench/frame_cost.py), but the host's work on 32 nodes' proposals
# made a 64-node frame's draft time 45 ms against 32 with 8 (bench/live_bench.py, RESULTS.md
# 2026-12-02): 8 it stays
WIDTH = 8
CHILDREN = 8  # continuations kept per node
# a step's attention over a window of BLOCKS_FROM slots or more runs in blocks of BLOCK side by side
# (``kv.StaticKV.in_blocks``): an H100, a 0.5B draft's 24 layers at 9 rows: 0.77 ms against 1.09 with
# SDPA at 2048 slots, 0.86 against 1.92 at 4096, but 0.74 against 0.68 at 1024 (bench/draft_attention.py)
BLOCK = kv.DRAFT_BLOCK  # 128: the draft's cache holds whole blocks (``kv.draft_slots``)
BLOCKS_FROM = 2048


class Drafter:
    def __init__(self, model: ModelSlice, width: int = WIDTH, children: int = CHILDREN, pool: int = 256,
                 blocks_from: int | None = None, fuse: bool = True):
        self.model, self.width, self.vocab = model, width, model.config.vocab_size
        if fuse:  # q/k/v and gate/up as one GEMM each: three kernels fewer a layer (``model.fused``)
            model.fuse_projections()
        blocks_from = BLOCKS_FROM if blocks_from is None else blocks_from
        model.attend_in_blocks(BLOCK if blocks_from else 0, blocks_from)  # the steps' (tree forwards') attention
        self.rows = width + 1  # the nodes a step expands, and room for a committed node to catch up
        self.children = min(children, self.vocab)
        self.device = model.device
        self.scratch = Scratch(model, pool)
        self.forward = model.forward  # the expansion step's: compiled by ``capture(compile=True)``
        self.graphs = GraphTable()  # keys: ("expand", sampled)

    # -- graphs --------------------------------------------------------------------------------
    def capture(self, log=None, compile: bool = False) -> bool:
        """Capture the expansion forward, greedy and sampled, as one CUDA graph per attention window
        that holds the pool.

        With ``compile``, the draft's forward is first compiled by torch.compile for each window
        (one compile each at the start; Inductor's cache on disk shortens later starts): Inductor
        fuses the many small elementwise kernels of a small model's step, and the compiled code runs
        inside the hand-captured graphs. Compiled numerics differ slightly from eager, which is
        harmless here: a draft token is only a proposal, the target decides. Measured by
        bench/frame_cost.py (an H100, a 0.5B draft, 9 rows): 2.37 ms a step compiled against 3.81
        plain at a 500-token context, 3.67 against 5.16 at 3000; one compile over all slots (what
        this did before) took 5.97 / 5.51, its attention reading every slot at every step."""
        m = self.model
        windows = [w for w in m.windows if w >= self.scratch.size + 1]
        if compile:
            self.forward = torch.compile(self.model.forward, dynamic=False)
            allow_recompiles(len(windows))
        inputs = self._inputs([])
        knobs = sampling.Knobs.of(Sampling(temperature=1.0), self.device).tensors()
        for sampled in (False, True):
            self.graphs.capture(("expand", sampled), f"draft's {self.rows}-node step", self._expand,
                                inputs + (knobs if sampled else ()), windows, log)
        return bool(self.graphs)

    def _expand(self, ids, slots, rope, base, visible, *args):
        """The plain function graphs capture: the rows' forward and each row's likeliest children
        (log-probabilities and tokens, (width, children) each)."""
        *knobs, window = args
        logits = self.forward(ids, slots, n_logits=ids.shape[0], window=window, tree=TreeMask(rope, base, visible))
        probs = logits.float().softmax(-1) if not knobs else sampling.warp(logits, sampling.Knobs(*knobs))
        return probs.topk(self.children, dim=-1)

    # -- the context ---------------------------------------------------------------------------
    def sync(self, tokens: list[int]) -> int:
        """Make ``tokens`` the draft's context (the pool starts after it, empty); returns how many
        positions were fed (the rest was cached). The feeding runs the plain forward, never the
        step's compiled one: its pieces differ in length from reply to reply, and a compiled
        forward of fixed shapes would compile anew for each (seconds each, then dynamo's limit)."""
        m = self.model
        start = m.reusable(tokens)
        window = m.window_for(len(tokens) + self.scratch.size)
        for i in range(start, len(tokens), PREFILL_CHUNK):
            piece = tokens[i:i + PREFILL_CHUNK]
            ids = self._ids(piece)
            m.forward(ids, torch.arange(i, i + len(piece), device=self.device), 1, window)  # plain: see sync
        m.note(start, tokens[start:])
        self.scratch.reset(len(tokens))
        return len(tokens) - start

    def reset(self) -> None:
        self.model.reset()
        self.scratch.reset(0)

    # -- expansion ------------------------------------------------------------------------------
    def expand(self, rows: list[tuple[int, int, object, list]], s: Sampling) -> list[list[tuple[int, float]]]:
        """``rows``: (token, position, key, ancestor keys) of at most ``self.rows`` nodes, each key
        written at its slot in ``scratch`` (taken there if it holds none) and seeing its ancestors'
        slots; each row's continuations, likeliest first."""
        inputs = self._inputs(rows)
        window = self.model.window_for(self.scratch.end)
        sampled = s.temperature > 0
        extra = sampling.Knobs.of(s, self.device).tensors() if sampled else ()
        probs, tokens = self.graphs.run(("expand", sampled), self._expand, inputs + extra, window)
        values = torch.cat([probs[:len(rows)].double().flatten(), tokens[:len(rows)].double().flatten()]).tolist()
        c, n = self.children, len(rows)  # ^ the one host sync of the step
        return [[(int(values[n * c + r * c + j]), values[r * c + j]) for j in range(c)] for r in range(n)]

    def _inputs(self, rows) -> tuple[torch.Tensor, ...]:
        """The padded inputs of ``rows``: ids, slots, rotary positions, base, visible (rows, scratch)."""
        slots, mask = self.scratch.tree_inputs([(pos, key, ancestors) for _, pos, key, ancestors in rows], self.rows,
                                               self.device)
        ids = self._ids([token for token, _, _, _ in rows] + [0] * (self.rows - len(rows)))
        return (ids, slots, *mask.tensors())

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        # a token the draft's (possibly smaller) vocabulary lacks can only hurt its proposals
        return torch.tensor(tokens, dtype=torch.long, device=self.device).clamp_(max=self.vocab - 1)
