"""CUDA-graph capture of fixed-shape forwards (the draft's expansion step, the frames' forwards).

Contract
--------
``Graphed(fn, example_inputs)`` warms ``fn`` up, captures one call into a ``torch.cuda.CUDAGraph``
and afterwards runs it by copying new inputs into the captured input buffers and replaying: the
same kernels on the same shapes, so the results are bit-identical to eager execution, without
Python launch overhead. A call returns copies of the graph's outputs (fresh tensors, safe to keep).

Memory: every graph of one device is warmed up and captured on that device's one capture stream
(``capture_stream``) into that device's one memory pool (``memory_pool``). A graph's temporaries
are dead once it has run, so the next graph captured there reuses them: a device's graphs need
the largest graph's temporaries once, plus each graph's outputs (``memory.py`` counts them so).
That is why a call copies the outputs: another graph of the pool may reuse their memory for its
temporaries, so a graph's own buffers are only valid until the next replay of any graph on that
device. One stream per device also means one cuBLAS workspace per device for all captures (a
new stream per graph would hold one each) and that a graph of ``cuda:1`` is captured on a stream
of ``cuda:1`` (torch's default capture stream belongs to the device current when it was made).

Warm-up and capture really execute ``fn``: callers capture before any conversation, while
the KV slots those calls write are not yet part of any context (they are overwritten later).
``try_capture`` turns a failure into ``None`` plus one warning, so callers fall back to eager.
Graph state is thread-local: capture and replay on the thread that owns CUDA.

A forward is captured once per attention window (see ``kv.StaticKV.windows``); ``pick`` finds
the graph of the smallest captured window that holds a forward's positions.

``GraphTable`` is the one place where the choice between a graph and the plain code is made,
for the slices and the draft alike: ``capture(key, what, fn, inputs, windows)`` captures
``fn(*inputs, window)`` once per window under ``key`` (a shape: a slice's tokens, logits and
segment, the draft's ``("expand", sampled)``); ``run(key, fn, inputs, window)`` replays the
graph that fits and otherwise calls ``fn(*inputs, window)`` itself: the CPU, and any shape not
captured, run exactly the code a graph replays. ``GraphTable(compile=options)`` compiles each
key's function by torch.compile (``code``: once per key, a program per window) and captures and
runs that instead, on any device: the one place where a slice's forwards are compiled whole.
Keys are the owner's own; nothing else reads them (``key in table`` tells whether one was
captured, ``keys()`` lists them).
"""

from __future__ import annotations

import types
import warnings

import torch


_streams: dict[torch.device, "torch.cuda.Stream"] = {}
_pools: dict[torch.device, tuple] = {}


def _indexed(device: torch.device) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)


def capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """The side stream on which every graph of ``device`` is warmed up and captured."""
    device = _indexed(device)
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def memory_pool(device: torch.device) -> tuple:
    """The memory pool that every graph of ``device`` is captured into."""
    device = _indexed(device)
    if device not in _pools:
        with torch.cuda.device(device):
            _pools[device] = torch.cuda.graph_pool_handle()
    return _pools[device]


def _copies(outputs):
    return outputs.clone() if isinstance(outputs, torch.Tensor) else type(outputs)(x.clone() for x in outputs)


class Graphed:
    def __init__(self, fn, example_inputs: tuple[torch.Tensor, ...], warmup: int = 2):
        self.inputs = tuple(x.clone() for x in example_inputs)
        self.device = device = self.inputs[0].device
        stream = capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(warmup):  # lets cuBLAS/SDPA pick and cache their kernels before capture
                fn(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=memory_pool(device), stream=stream), torch.no_grad():
            self.outputs = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor):
        with torch.cuda.device(self.device):  # inputs, replay and copies on the graph's device's stream
            for buf, x in zip(self.inputs, inputs):
                buf.copy_(x, non_blocking=True)
            self.graph.replay()
            return _copies(self.outputs)


def try_capture(what: str, fn, example_inputs, log=None):
    """A ``Graphed`` for ``fn``, or None (after one warning) when capture is impossible."""
    if not example_inputs[0].is_cuda:
        return None
    try:
        with torch.cuda.device(example_inputs[0].device):  # a draft on cuda:1 captures on cuda:1's streams
            return Graphed(fn, example_inputs)
    except Exception as exc:  # any capture failure must leave a working eager path behind
        message = f"CUDA graph capture of the {what} failed ({type(exc).__name__}: {exc}); running it eagerly"
        (log or (lambda m: warnings.warn(m, RuntimeWarning, stacklevel=2)))(message)
        torch.cuda.synchronize()
        return None


def capture_windows(what: str, fn, example_inputs, windows, log=None) -> dict[int, Graphed]:
    """One graph of ``fn(*inputs, window)`` per attention window, ascending; stops at the first
    window that cannot be captured (warned once), whose forwards and wider ones then run eagerly."""
    graphs: dict[int, Graphed] = {}
    for window in windows:
        graph = try_capture(f"{what} over {window} slots", lambda *xs, w=window: fn(*xs, w), example_inputs, log)
        if graph is None:
            break
        graphs[window] = graph
    return graphs


def pick(graphs: dict[int, Graphed], window: int) -> Graphed | None:
    """The graph captured for the smallest window of at least ``window`` slots, or None."""
    fits = [w for w in graphs if w >= window]
    return graphs[min(fits)] if fits else None


class GraphTable:
    def __init__(self, compile: dict | None = None) -> None:
        """``compile``: torch.compile's options when the table compiles what it captures and runs
        (``code``); None: the plain functions."""
        self._graphs: dict[object, dict[int, Graphed]] = {}
        self.compile = compile
        self._code: dict = {}  # key -> its function compiled
        self._proven = False  # a compiled function has run: a later failure is an error, not a fallback

    def code(self, key, fn):
        """What runs under ``key``: ``fn`` itself, or (a compiling table) ``fn`` compiled once for the
        key (the first ``fn`` given: a key's functions are one function), one program per window
        (``dynamic=False``), whole (``fullgraph``). Where compiling fails before any compiled
        function of the table has run (a kernel library's op dynamo cannot trace, a GPU Triton
        does not know), the table runs the plain functions from then on, warned once (so every
        forward of the slice runs one code); a failure after that is raised."""
        if self.compile is None:
            return fn
        if key not in self._code:
            # a code object of its own: dynamo keeps its programs per code object, so this key's are
            # never checked against another key's or another slice's guards (torch 2.13 on a CPU
            # failed analysing a dead slice's guards when a new slice's function recompiled)
            own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                                     fn.__closure__)
            own.__kwdefaults__ = fn.__kwdefaults__
            compiled = torch.compile(own, dynamic=False, fullgraph=True, options=self.compile or None)

            def run(*args):
                if self.compile is None:  # compiling failed in this table: the plain code
                    return fn(*args)
                try:
                    out = compiled(*args)
                except Exception as exc:
                    if self._proven:
                        raise
                    warnings.warn(f"compiling the forwards failed ({type(exc).__name__}: {exc}); running them "
                                  "uncompiled", RuntimeWarning, stacklevel=2)
                    self.compile = None
                    return fn(*args)
                self._proven = True
                return out
            self._code[key] = run
        return self._code[key]

    def capture(self, key, what: str, fn, example_inputs, windows, log=None) -> bool:
        """Graphs of ``fn(*inputs, window)`` (``code``) for ``windows`` under ``key``; False when none could be."""
        graphs = capture_windows(what, self.code(key, fn), example_inputs, windows, log)
        if graphs:
            self._graphs[key] = graphs
        return bool(graphs)

    def run(self, key, fn, inputs: tuple, window: int):
        """``fn(*inputs, window)`` (``code``), replayed from the graph captured for ``key`` when one fits."""
        graph = pick(self._graphs.get(key, {}), window)
        return graph(*inputs) if graph is not None else self.code(key, fn)(*inputs, window)

    def __contains__(self, key) -> bool:
        return key in self._graphs

    def keys(self) -> list:
        return list(self._graphs)

    def windows(self, key) -> list[int]:
        """The attention windows captured under ``key``, ascending."""
        return sorted(self._graphs.get(key, {}))

    def __bool__(self) -> bool:
        return bool(self._graphs)

    def __len__(self) -> int:
        return sum(map(len, self._graphs.values()))

    def clear(self) -> None:
        self._graphs.clear()
