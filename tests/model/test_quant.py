"""NF4 and int8 (bitsandbytes, CPU backend here): slices swap their layers' linears for Linear4bit
or Linear8bitLt, the engine keeps greedy parity with transformers' generate() of the same
quantised model, the hello tells the tail to quantise its slice the same way, and the flags reach
the settings."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sfchat import UserError
from sfchat.protocol import wire
from sfchat.cli import build_parser, settings_from
from sfchat.config import Settings
from sfchat.events import ReplyFinished, RuntimeReady
from sfchat.model.quant import NF4_BYTES_PER_WEIGHT, bytes_per_weight, check_mode, is_quantized, quantize_linears
from sfchat.node.head import Head
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.engine.verifier import TailError, Verifier
from sfchat.node.tail_loader import TailLoader
from sfchat.protocol.wire import Sampling

CPU = torch.device("cpu")
IDS = [1, 17, 42, 99, 5, 250, 7, 300, 64, 12, 88, 3]
PROMPT = [{"role": "user", "content": "hello world, how are you?"}]


def nf4_reference(path, quant="nf4"):
    """transformers' own model of the checkpoint with the same swap: an independent forward."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert quantize_linears(model.model.layers, torch.float32, quant) == 7 * model.config.num_hidden_layers
    return model


def load(path, lo, hi, quant, **kw):
    return ModelSlice.load(ModelSource.open(str(path)), lo, hi, dtype=torch.float32, device=CPU, max_len=32,
                           quant=quant, **kw)


@pytest.mark.parametrize("quant, target", [("nf4", "qwen2-untied"), ("nf4", "llama-tied"), ("nf4", "qwen3-untied"),
                                           ("int8", "qwen2-untied"), ("int8", "llama-tied")])
def test_quantised_slices_match_the_quantised_reference_and_differ_from_dense(zoo, quant, target):
    path = zoo[target]
    head = load(path, 0, 2, quant, embed=True, head=False)
    tail = load(path, 2, 4, quant, embed=False, head=True)
    dense_tail = load(path, 2, 4, "none", embed=False, head=True)
    for layer in list(head.layers) + list(tail.layers):
        kinds = {type(m).__name__ for m in layer.modules()}
        assert {"nf4": "Linear4bit", "int8": "Linear8bitLt"}[quant] in kinds and "Linear" not in kinds
        if quant == "int8":
            assert layer.mlp.up_proj.weight.dtype == torch.int8 and layer.mlp.up_proj.state.threshold == 0.0
    assert type(tail.lm_head) is torch.nn.Linear and type(head.embed_tokens) is torch.nn.Embedding
    assert is_quantized(head)
    if quant == "nf4":
        assert head.layers[0].mlp.up_proj.weight.quant_state.nested  # double quantisation
    if target.startswith("qwen2"):  # q/k/v biases stay dense
        assert head.layers[0].self_attn.q_proj.bias.dtype == torch.float32

    n = len(IDS)
    hidden = head(torch.tensor(IDS), torch.arange(n))
    logits = tail(hidden, torch.arange(n), n_logits=n)
    with torch.no_grad():
        expected = nf4_reference(path, quant)(torch.tensor([IDS])).logits[0]
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    apart = {"nf4": 1e-3, "int8": 1e-4}[quant]  # how far from the dense slice's logits at least
    assert not torch.allclose(logits, dense_tail(hidden, torch.arange(n), n_logits=n), atol=apart)


def test_nf4_weights_take_about_a_quarter_of_fp16(zoo):
    dense = load(zoo["llama-untied"], 0, 4, "none", embed=False, head=False)
    nf4 = load(zoo["llama-untied"], 0, 4, "nf4", embed=False, head=False)

    def linear_bytes(sl):
        out = 0
        for m in sl.modules():
            if type(m).__name__ in ("Linear", "Linear4bit"):
                w = m.weight
                out += w.numel() * w.element_size()
                qs = getattr(w, "quant_state", None)
                if qs is not None:
                    out += qs.absmax.numel() * qs.absmax.element_size() + qs.state2.absmax.numel() * 4
        return out

    n_weights = linear_bytes(dense) // 4
    assert linear_bytes(nf4) == pytest.approx(n_weights * NF4_BYTES_PER_WEIGHT, rel=0.05)


@pytest.mark.parametrize("target, draft", [("qwen2-untied", "draft"), ("llama-tied", "llama-tied"),
                                           ("qwen3-tied", "draft")])
def test_greedy_parity_with_an_nf4_target(zoo, target, draft):
    session = Head.open(Settings(model=str(zoo[target]), draft=str(zoo[draft]), k=4, device="cpu",
                                        load_in_4bit=True))
    assert session.info.quant == "nf4" and is_quantized(session.engine.head)
    assert not is_quantized(session.engine.drafter.model)
    tail = session.engine.link.verifier
    assert tail.hello.quant == "nf4" and is_quantized(tail.model)
    ids = session.encode(PROMPT)
    fin = [e for e in session.reply(ids, 24, Sampling()) if isinstance(e, ReplyFinished)][0]
    ref = nf4_reference(zoo[target]).generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                              pad_token_id=0)
    assert list(fin.token_ids) == ref[0, len(ids):].tolist()


def test_nf4_draft_keeps_the_dense_target_lossless(zoo):
    path = zoo["qwen2-tied"]
    session = Head.open(Settings(model=str(path), draft=str(path), k=4, device="cpu",
                                        draft_load_in_4bit=True))
    assert is_quantized(session.engine.drafter.model) and not is_quantized(session.engine.head)
    assert session.info.quant == "none" and session.engine.link.verifier.hello.quant == "none"
    ids = session.encode(PROMPT)
    fin = [e for e in session.reply(ids, 24, Sampling()) if isinstance(e, ReplyFinished)][0]
    ref = AutoModelForCausalLM.from_pretrained(path).eval().generate(
        torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert list(fin.token_ids) == ref[0, len(ids):].tolist()


def hello(path, **extra):
    data = {"model": str(path), "revision": None, "split": 2, "dtype": "float32", "max_len": 32,
            "n_layers": 4, "hidden_size": 64, "k": 2, "graphs": False, **extra}
    return wire.encode(wire.Control(wire.MsgType.HELLO, data))


def test_the_hello_names_the_quantisation_and_the_tail_follows(zoo):
    path = zoo["llama-untied"]
    tail = Verifier(TailLoader(CPU))
    out = []
    tail.handle(hello(path, quant="nf4"), out.append)
    ready = wire.decode(out[-1])
    assert ready.type is wire.MsgType.READY and not ready.data["reused"] and is_quantized(tail.model)
    tail.handle(hello(path, quant="nf4"), out.append)
    assert wire.decode(out[-1]).data["reused"]
    tail.handle(hello(path), out.append)  # an older head sends no "quant": dense, and a reload
    assert not wire.decode(out[-1]).data["reused"] and not is_quantized(tail.model)
    with pytest.raises(TailError, match="unknown quantisation 'int3'"):
        tail.handle(hello(path, quant="int3"), out.append)
    assert wire.decode(out[-1]).type is wire.MsgType.ERROR


def test_flags_and_config_file(tmp_path):
    s = settings_from(build_parser().parse_args(["--load-in-4bit", "--draft-load-in-4bit"]))
    assert s.load_in_4bit and s.draft_load_in_4bit
    s = settings_from(build_parser().parse_args([]))
    assert not s.load_in_4bit and not s.draft_load_in_4bit
    conf = tmp_path / "c.toml"
    conf.write_text("load-in-4bit = true\n")
    assert settings_from(build_parser().parse_args(["--config", str(conf)])).load_in_4bit
    with pytest.raises(UserError, match=r"unknown quantisation 'fp8' \(choose from none, nf4, int8\)"):
        check_mode("fp8")
    assert RuntimeReady("m", "d", 1, 2, "float32", 1, "cpu", "local", 8).quant == "none"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quant, dtype", [("nf4", torch.bfloat16), ("int8", torch.float16), ("int8", torch.bfloat16)])
def test_graphed_quantised_verify_is_bit_identical_to_eager(zoo, quant, dtype):
    """int8 layers are captured; NF4 ones may run eagerly instead, but then it says so."""
    dev = torch.device("cuda")
    src = ModelSource.open(str(zoo["qwen2-untied"]))
    tail = ModelSlice.load(src, 2, 4, embed=False, head=True, dtype=dtype, device=dev, max_len=64, quant=quant)
    messages = []
    captured = tail.capture(9, 9, log=messages.append)
    if quant == "int8":
        assert captured, messages
    else:
        assert captured or (messages and "running it eagerly" in messages[0])
    hidden = torch.randn(9, 64, dtype=dtype, device=dev)
    pos = torch.arange(9, device=dev)
    eager = tail.forward(hidden, pos, 9).clone()
    assert torch.equal(tail.run(hidden, pos, 9).clone(), eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quant, flags", [("nf4", {"load_in_4bit": True, "draft_load_in_4bit": True}),
                                          ("int8", {"load_in_8bit": True})])
def test_graphed_engine_with_a_quantised_target_keeps_greedy_parity(zoo, quant, flags):
    """NF4 quantises the draft too (its layers graphed as well); int8 only the target."""
    path = zoo["qwen2-tied"]
    session = Head.open(Settings(model=str(path), draft=str(path), k=4, device="cuda", dtype="float32",
                                 compile_draft=False, **flags))
    ids = session.encode(PROMPT)
    fin = [e for e in session.reply(ids, 24, Sampling()) if isinstance(e, ReplyFinished)][0]
    model = AutoModelForCausalLM.from_pretrained(path).cuda().eval()
    quantize_linears(model.model.layers, torch.float32, quant)
    ref = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert list(fin.token_ids) == ref[0, len(ids):].tolist()
    engine = session.engine
    assert engine.head.graphs and engine.link.verifier.model.graphs  # the quantised layers graphed
    if quant == "nf4":
        assert engine.drafter.graphs
    print(f"\n{quant} on CUDA: head graphs {engine.head.graphs.keys()}, draft graphs {engine.drafter.graphs.keys()}, "
          f"tail graphs {engine.link.verifier.model.graphs.keys()}")


def test_int8_weights_take_about_half_of_fp16_as_the_estimate_counts(zoo):
    path = zoo["llama-untied"]
    dense, int8 = (load(path, 0, 4, q, embed=False, head=False) for q in ("none", "int8"))
    linears = [m for m in int8.modules() if type(m).__name__ == "Linear8bitLt"]
    stored = sum(m.weight.numel() * m.weight.element_size() + m.weight.SCB.numel() * 4 for m in linears)
    n_weights = sum(m.weight.numel() for m in dense.modules() if type(m) is torch.nn.Linear)
    config = ModelSource.open(str(path)).config
    min_in = min(config.hidden_size, config.intermediate_size)
    assert n_weights <= stored <= n_weights * bytes_per_weight("int8", torch.float32, min_in)


@pytest.mark.parametrize("target, draft", [("qwen2-untied", "draft"), ("llama-tied", "llama-tied")])
def test_greedy_parity_with_an_int8_target(zoo, target, draft):
    session = Head.open(Settings(model=str(zoo[target]), draft=str(zoo[draft]), k=4, device="cpu",
                                 load_in_8bit=True))
    assert session.info.quant == "int8" and is_quantized(session.engine.head)
    tail = session.engine.link.verifier
    assert tail.hello.quant == "int8" and is_quantized(tail.model)
    ids = session.encode(PROMPT)
    fin = [e for e in session.reply(ids, 24, Sampling()) if isinstance(e, ReplyFinished)][0]
    ref = nf4_reference(zoo[target], "int8").generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                                      pad_token_id=0)
    assert list(fin.token_ids) == ref[0, len(ids):].tolist()


def test_the_8bit_flag_reaches_the_settings_and_excludes_the_4bit_one(zoo):
    s = settings_from(build_parser().parse_args(["--load-in-8bit"]))
    assert s.load_in_8bit and s.quant() == "int8"
    assert Settings().quant() == "none" and Settings(load_in_4bit=True).quant() == "nf4"
    with pytest.raises(UserError, match="--load-in-4bit and --load-in-8bit exclude each other"):
        Head.open(Settings(model=str(zoo["llama-tied"]), draft="none", device="cpu", load_in_4bit=True,
                           load_in_8bit=True))
    tail = Verifier(TailLoader(CPU))
    out = []
    tail.handle(hello(zoo["llama-untied"], quant="int8"), out.append)
    assert wire.decode(out[-1]).type is wire.MsgType.READY and is_quantized(tail.model)
