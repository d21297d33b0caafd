"""Canonical attention compiled (``attention.on_gpu``, ``run_on_gpu``): checked on the CPU, where
torch.compile traces the same function (the GPU's kernels: tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from sfchat.model import attention, kv
from sfchat.model.kv import Attend

HEADS, KV_HEADS, DIM, ROWS, SLOTS = 4, 2, 16, 6, 2 * kv.BLOCK


def inputs(seed: int = 0):
    """A query of ``ROWS`` rows, the buffers, and an ``Attend`` whose context part covers two
    blocks (the second empty for every row) and whose own part reads slots past the window."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(1, HEADS, ROWS, DIM, generator=gen)
    key, value = (torch.randn(1, KV_HEADS, SLOTS + kv.SPAN, DIM, generator=gen) for _ in range(2))
    cut = torch.tensor([100, 200, 300, 400, 500, 0])  # each row's context part ends here (the last has none)
    bias = torch.where(torch.arange(SLOTS)[None] < cut[:, None], 0.0, torch.finfo(torch.float32).min)
    bias = bias.repeat(HEADS // KV_HEADS, 1)
    context = torch.stack([cut > 0, torch.zeros(ROWS, dtype=torch.bool)])
    keys = torch.randint(0, SLOTS + kv.SPAN, (ROWS, kv.SPAN), generator=gen)
    own = torch.zeros(ROWS, kv.SPAN)
    own[:, :kv.SPAN // 2] = torch.finfo(torch.float32).min  # half of each row's own positions are absent
    return query, key, value, Attend(bias, context, keys, own), DIM ** -0.5


@pytest.fixture
def fresh(monkeypatch):
    """``attention``'s compile state as a new process has it, with compiling on; dynamo's settings,
    which compiling changes for the process, restored afterwards."""
    import torch._dynamo as dynamo

    monkeypatch.setattr(attention, "COMPILE", True)
    monkeypatch.setattr(attention, "_compiled", None)
    monkeypatch.setattr(attention, "_proven", False)
    for name in ("recompile_limit", "accumulated_recompile_limit", "fail_on_recompile_limit_hit"):
        monkeypatch.setattr(dynamo.config, name, getattr(dynamo.config, name))


def test_compiled_canonical_attention_computes_what_the_plain_function_does(fresh):
    run = attention.on_gpu()
    assert run is not attention.canonical
    args = inputs()
    got, want = attention.run_on_gpu(*args), attention.canonical(*args)
    assert attention._proven and attention._compiled is run
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()


def test_the_head_applies_its_setting_before_it_loads(zoo, monkeypatch):
    from sfchat.config import Settings
    from sfchat.node import loading

    monkeypatch.setattr(attention, "COMPILE", False)

    class Stop(Exception):
        pass

    def opened(*a, **kw):  # the first thing the head loads: compiling must be decided by then
        assert attention.COMPILE is True
        raise Stop

    monkeypatch.setattr(loading.ModelSource, "open", opened)
    with pytest.raises(Stop):
        loading.open_engine(Settings(model=str(zoo["qwen2-untied"]), device="cpu", compile_attention=True))


def test_a_first_compiled_call_that_fails_leaves_the_plain_function_for_the_process(fresh, monkeypatch):
    def cannot(fn, **kw):
        def broken(*args):
            raise RuntimeError("no Triton for this GPU")
        return broken

    monkeypatch.setattr(torch, "compile", cannot)
    args = inputs()
    with pytest.warns(RuntimeWarning, match=r"canonical attention runs uncompiled \(RuntimeError: no Triton"):
        got = attention.run_on_gpu(*args)
    assert torch.equal(got, attention.canonical(*args))
    assert attention._compiled is attention.canonical  # from now on, every shape alike
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(attention.run_on_gpu(*inputs(1)), attention.canonical(*inputs(1)))


def test_an_install_that_cannot_set_up_the_compile_runs_the_plain_function(fresh, monkeypatch):
    def cannot(fn, **kw):
        raise RuntimeError("torch.compile is not supported here")

    monkeypatch.setattr(torch, "compile", cannot)
    args = inputs()
    with pytest.warns(RuntimeWarning, match=r"runs uncompiled \(RuntimeError: torch.compile is not supported"):
        assert torch.equal(attention.run_on_gpu(*args), attention.canonical(*args))
    assert attention._compiled is attention.canonical


def test_an_option_this_torch_lacks_is_left_out_and_said(fresh, monkeypatch):
    given = {}

    def compiled(fn, **kw):
        given.update(kw["options"] or {})
        return lambda *args: fn(*args)

    monkeypatch.setattr(torch, "compile", compiled)
    monkeypatch.setattr(attention, "OPTIONS", {"emulate_precision_casts": True, "no_such_option": 1})
    with pytest.warns(RuntimeWarning, match=r"compiles without \['no_such_option'\]"):
        attention.run_on_gpu(*inputs())
    assert given == {"emulate_precision_casts": True} and attention._proven


def test_after_a_compiled_call_ran_a_failure_is_an_error_not_another_code(fresh, monkeypatch):
    calls = []

    def once(fn, **kw):
        def flaky(*args):
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("recompile limit")
            return fn(*args)
        return flaky

    monkeypatch.setattr(torch, "compile", once)
    attention.run_on_gpu(*inputs())
    with pytest.raises(RuntimeError, match="recompile limit"):
        attention.run_on_gpu(*inputs(1))
    assert attention._compiled is not attention.canonical
