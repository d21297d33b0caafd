"""The benchmarks' own pieces that decide what their figures mean (bench/live_bench.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from live_bench import draw_ranks, synthetic_proposals  # noqa: E402

RANKS = [727, 133, 53, 24, 25, 11, 4, 2, 21]  # a real pair's histogram; the last: not proposed


@pytest.mark.parametrize("children", [1, 8])
def test_every_mode_drafts_at_the_same_quality(children):
    """The synthetic draft proposes the target's next token at a rank drawn from the whole
    histogram, whatever the frame's width: a chain (one child) is right as often as rank 0 is, not
    as often as rank 0 against "not proposed" (0.97 here), which flattered the chain baseline."""
    n = 40_000
    perm = [(7 * t + 3) % n for t in range(n)]
    rank = draw_ranks(RANKS, n)
    q = [r / sum(RANKS) for r in RANKS[:children]]
    hits = [sum(tok == perm[t] for tok, _ in synthetic_proposals(t, perm, rank, q, children)) for t in range(n)]
    share = sum(hits) / n
    assert share == pytest.approx(sum(RANKS[:children]) / sum(RANKS), abs=0.01)
    assert max(hits) == 1  # the target's token once at most, decoys elsewhere


def test_the_policy_simulator_prints_a_row_per_rule():
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "bench" / "policy_flips.py"), "--runs", "4", "--ms", "3000",
                          "--rtts", "86", "--ratios", "1.25", "--rules", "2:6:4000,0:2:0", "--burst", "0.5"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    rows = [line for line in out.splitlines() if line.startswith("| 2, 6, 4000 |") or line.startswith("| 0, 2, 0 |")]
    assert [r.split(" | ")[0] for r in rows] == ["| 2, 6, 4000", "| 0, 2, 0"]
    assert all(r.split(" | ")[1:5] == ["10 trips in 300-1000, 12", "3000", "86", "1.25"] for r in rows)
    fixed = subprocess.run([sys.executable, str(root / "bench" / "policy_flips.py"), "--runs", "2", "--ms", "1000",
                            "--rtts", "0", "--ratios", "1.0", "--trials", "1000:12"],
                           capture_output=True, text=True, check=True, timeout=300).stdout
    assert "| 2, 6, 4000 | 1000, 12 | 1000 | 0 | 1.00 |" in fixed  # a trial of 1000 ms whatever the trip


def test_timed_parts_times_each_call_and_puts_the_methods_back():
    from live_bench import timed_parts

    class Part:
        def step(self, x):
            return x + 1

    obj = Part()
    obj.own = lambda x: x * 2  # an instance's own attribute stays its own
    parts, restore = timed_parts([(obj, "own"), (Part, "step")], cuda=False)
    assert obj.step(1) == 2 and obj.step(2) == 3 and obj.own(4) == 8
    assert len(parts["step"]) == 2 and len(parts["own"]) == 1 and all(ms >= 0 for ms in parts["step"])
    restore()
    assert "step" not in vars(obj) and vars(Part)["step"].__name__ == "step" and obj.own(4) == 8
    assert obj.step(5) == 6 and len(parts["step"]) == 2  # no longer timed


def test_live_bench_saves_every_mode_as_it_ends_whole_files_only(tmp_path):
    """A GPU run cut by its timeout lost every reply's token ids (seventh session): the results
    are written after each mode, each time a whole file renamed into place."""
    import json

    from live_report import save

    out = tmp_path / "run.json"
    res = {("chain", 0): {"tps": 1.5, "ids": [[1, 2]]}}
    save(out, res)
    assert json.loads(out.read_text()) == [{"mode": "chain", "rtt": 0, "tps": 1.5, "ids": [[1, 2]]}]
    res[("tree", 86)] = {"tps": 2.0, "ids": [[3]]}
    save(out, res)
    assert [(r["mode"], r["rtt"], r["ids"]) for r in json.loads(out.read_text())] == [("chain", 0, [[1, 2]]),
                                                                                     ("tree", 86, [[3]])]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_live_bench_counts_the_verdicts_that_committed_nothing():
    from live_bench import summary

    from sfchat.events import RoundStats

    def verdict(committed):
        return RoundStats(accepted=max(0, committed - 1), committed=committed, draft_ms=1.0, head_ms=1.0,
                          tail_ms=1.0, rtt_ms=1.0, round_ms=5.0)
    out = summary([verdict(3), verdict(0), verdict(0), verdict(1)], tokens=4, wall=0.02, inflight=4)
    assert out["empty"] == 0.5 and out["tokens_per_verdict"] == 1.0 and out["verdicts"] == 4


def test_live_bench_saves_every_verdicts_figures_in_order_when_asked():
    from live_report import VERDICT_FIELDS, verdict_rows

    from sfchat.events import RoundStats

    stats = [RoundStats(accepted=2, committed=3, draft_ms=4.0, head_ms=5.0, tail_ms=6.0, rtt_ms=170.0, round_ms=30.0,
                        in_flight=7, expected=2.5, forward_bytes=9000, schedule="stream", draft_steps=2, wait_ms=1.5),
             RoundStats(accepted=0, committed=1, draft_ms=20.0, head_ms=8.0, tail_ms=9.0, rtt_ms=180.0, round_ms=220.0,
                        schedule="round")]
    out = verdict_rows(stats)
    assert out["fields"][:3] == ["schedule", "committed", "expected"] and len(out["fields"]) == len(VERDICT_FIELDS)
    assert [dict(zip(out["fields"], r)) for r in out["rows"]] == [
        {"schedule": "stream", "committed": 3, "expected": 2.5, "in_flight": 7, "rtt_ms": 170.0, "tail_ms": 6.0,
         "round_ms": 30.0, "draft_ms": 4.0, "head_ms": 5.0, "forward_bytes": 9000, "draft_steps": 2, "ahead_steps": 0,
         "wait_ms": 1.5},
        {"schedule": "round", "committed": 1, "expected": 0.0, "in_flight": 1, "rtt_ms": 180.0, "tail_ms": 9.0,
         "round_ms": 220.0, "draft_ms": 20.0, "head_ms": 8.0, "forward_bytes": 0, "draft_steps": 0, "ahead_steps": 0,
         "wait_ms": 0.0}]


def test_shape_cost_times_every_variant_over_the_same_rows(tmp_path):
    """bench/shape_cost.py compares a verify forward at its own row count with the one row shape
    (plain and compiled canonical attention): its figures mean something only when every variant
    computes the same real rows of the same chain over the same context (fp32 on the CPU: equal to
    rounding)."""
    import json
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "cost.json"
    subprocess.run([sys.executable, str(root / "bench" / "shape_cost.py"), "--self", "tiny", "--device", "cpu",
                    "--dtype", "float32", "--reps", "2", "--context", "70", "--rows", "16", "--plain-rows", "1,5",
                    "--variants", "plain,one", "--prompt", "40", "--save", str(out)], check=True, capture_output=True, timeout=600)
    rows = json.loads(out.read_text())
    assert [(r["slice"], r["variant"], r["rows"], r["nodes"]) for r in rows] == [
        (s, v, n, k) for s in ("head", "tail") for v, n, k in
        (("plain 1", 1, 1), ("plain 5", 5, 5), ("plain", 512, 40), ("one shape", 16, 1), ("one shape", 16, 5),
         ("one shape", 16, 40))]
    assert all(r["ms"] > 0 and r["diff"] < 1e-4 for r in rows), rows


def _saved(path, cells):
    import json

    path.write_text(json.dumps([{"mode": m, "rtt": r, "tps": t, "round_ms": 10.0, "tokens_per_verdict": 2.0, "ids": ids}
                                for m, r, t, ids in cells]))
    return str(path)


def test_identity_table_merges_a_run_measured_in_pieces(tmp_path, capsys):
    """A GPU call lasts minutes, so a run of every mode at several RTTs is several live_bench
    processes: NAME=FILE,FILE... puts a run's pieces together; each cell's replies are counted
    against the run's own no-draft replies, and the runs against each other."""
    from identity_table import main

    a, b = [[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]
    one_a = _saved(tmp_path / "one_a.json", [("none", 0, 10.0, a), ("chain", 0, 20.0, a)])
    one_b = _saved(tmp_path / "one_b.json", [("tree", 86, 30.0, a)])
    two = _saved(tmp_path / "two.json", [("none", 0, 11.0, a), ("chain", 0, 22.0, a), ("tree", 86, 33.0, b)])
    assert main([f"one={one_a},{one_b}", two]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2:5] == ["| none | 0 | 2/2 / 10.0 / 10.0 / 2.00 | 2/2 / 11.0 / 10.0 / 2.00 |",
                        "| chain | 0 | 2/2 / 20.0 / 10.0 / 2.00 | 2/2 / 22.0 / 10.0 / 2.00 |",
                        "| tree | 86 | 2/2 / 30.0 / 10.0 / 2.00 | 1/2 / 33.0 / 10.0 / 2.00 |"]
    assert out[5:] == ["one: replies identical across every mode and RTT: 2 of 2",
                       "two: replies identical across every mode and RTT: 1 of 2",
                       "one against two: 5 of 6 replies the same, mode by mode"]


def test_identity_table_refuses_what_is_not_a_saved_run(tmp_path, capsys):
    from identity_table import main

    good = _saved(tmp_path / "good.json", [("none", 0, 1.0, [[1]])])
    assert main([f"x={tmp_path / 'nope.json'}"]) == 2 and "No such file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('[{"mode": "none"}]')
    assert main([str(tmp_path / "bad.json")]) == 2 and "not a live_bench --save file" in capsys.readouterr().err
    assert main([f"x={good}", f"x={good}"]) == 2 and "each name once" in capsys.readouterr().err
    assert main(["=" + good]) == 2 and "NAME=FILE" in capsys.readouterr().err
    assert main([]) == 2 and "at least one" in capsys.readouterr().err


def test_a_shared_gpu_stretches_head_work_by_the_verifies_it_meets():
    """pipeline_sim --shared-gpu: live_bench runs head and tail on one GPU, where a draft step that
    meets a verify gets only part of the card; two machines (share 0) share nothing."""
    from pipeline_sim import SharedGpu

    gpu = SharedGpu(0.5)
    gpu.book(0.010, 0.016)  # a verify from 10 to 16 ms
    assert gpu.stretch(0.0, 5.0) == pytest.approx(5.0)  # done before it starts
    assert gpu.stretch(0.008, 5.0) == pytest.approx(2 + 6 + 0)  # 2 ms alone, 3 ms at half speed in 6 ms
    assert gpu.stretch(0.012, 1.0) == pytest.approx(2.0)  # inside it: half speed
    assert gpu.stretch(0.012, 4.0) == pytest.approx(4 + 2)  # 2 ms of it at half speed, then 2 alone
    waits = SharedGpu(1.0)
    waits.book(0.010, 0.016)
    assert waits.stretch(0.008, 5.0) == pytest.approx(2 + 6 + 3)  # waits the verify out
    assert waits.stretch(0.020, 5.0) == pytest.approx(5.0)  # past it: as alone
    assert waits.busy == []  # verifies already over are forgotten


def test_the_simulated_tail_charges_no_verify_for_a_frame_whose_nodes_are_all_dead():
    """pipeline_sim's tail, like the Verifier, runs no forward for a frame a verdict voided (half
    of a stream's frames): its verdict comes back after the round trip alone, and the next frame's
    verify does not queue behind it."""
    from pipeline_sim import H200, Clock, SimLink
    from sfchat.protocol import wire

    class Tail:  # the Verifier's side of it: computes the frames flagged live, answers every frame
        computed = 0

        def handle(self, frame, emit):
            msg = wire.decode(frame)
            self.computed += msg.tokens[0] == 1
            emit(wire.encode(wire.Verdict(msg.round, msg.tree, (), ())))

    def forward(round_, live):
        return wire.encode(wire.Forward(round=round_, tree=1, start_pos=9, tokens=(1 if live else 2,), hidden=bytes(8),
                                        dtype=wire.DType.FLOAT32, hidden_size=2, parents=(0,), first_id=round_))

    clock = Clock()
    link = SimLink(clock, Tail(), 100.0, 0.0, H200 | {"seal_gbps": 1e9})
    sent = clock.now()
    link.send(forward(1, live=False))
    link.send(forward(2, live=True))
    link.send(forward(3, live=True))
    arrivals = [(wire.decode(link.recv()).round, (clock.now() - sent) * 1e3) for _ in range(3)]
    verify = H200["tail_ms"] + H200["tail_row_ms"]
    assert [r for r, _ in arrivals] == [1, 2, 3]
    assert [ms for _, ms in arrivals] == pytest.approx([100.0, 100.0 + verify, 100.0 + 2 * verify], abs=0.5)


def test_the_hedged_choice_is_the_trees_own_without_a_boost_and_sends_the_alternatives_first_with_one():
    """bench/hedge_sim.py's variants differ from the product only by the boost: at 1 its choice is
    ``LiveTree.choose``'s, node for node, on a tree grown under frames in flight."""
    import random

    from hedge_sim import hedged_choose
    from sfchat.engine.live import Calibration, LiveTree

    class Exact(Calibration):  # the draft's own probabilities: no two nodes tie (ties may go either way)
        def step(self, q, rank=0):
            return q

    rng = random.Random(3)
    tree = LiveTree([1, 2, 3], Exact())
    for _ in range(6):  # grow, send a frame, grow below it: candidates under nodes in flight and chosen ones
        for _ in range(2):
            for node in tree.expandable(4):
                probs = sorted((rng.random() for _ in range(3)), reverse=True)
                tree.expanded(node, [(rng.randrange(1000), p / sum(probs)) for p in probs])
        ours = hedged_choose(tree, 5, 10_000, 1.0)
        assert ours == tree.choose(5, 10_000) and len(ours) == 5
        tree.send(ours)
    pending = [n for n in tree.nodes() if not n.sent and n.parent.sent]
    alternative = max((n for n in pending if n.rank > 0), key=lambda n: n.logv)
    assert tree.choose(1, 10_000)[0] is not alternative  # the tree's first pick is a draft's first choice
    assert hedged_choose(tree, 1, 10_000, 1e6, alternatives=True) == [alternative]


def test_frame_cost_prints_each_draft_step_with_its_top_kernels_on_the_cpu():
    """bench/frame_cost.py --tiny runs the script's code on the CPU (nothing measured there): each
    expansion step a row, with --profile-draft its busiest ops, at the cache size asked for, after
    each context asked for (its window named), the attention masked and in blocks, the layers as
    loaded and with their projections merged (three linears a layer fewer: q/k/v one, gate/up one)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "bench" / "frame_cost.py"), "--tiny", "--profile-draft",
                          "--max-context", "1024", "--draft-only", "--draft-contexts", "100,700"],
                         capture_output=True, text=True, check=True, timeout=600, cwd=root).stdout
    steps = [line for line in out.splitlines() if "draft expansion step" in line]
    assert [s.split(" | ")[0] for s in steps] == [
        f"| tiny draft expansion step, {r} rows{how}, context {c}" for r, how in ((9, ""), (17, ""), (33, ""), (9, " (blocks)"),
                                                                       (9, " (blocks, fused)")) for c in (100, 700)]
    assert [s.split(" | ")[2].split(";")[0] for s in steps[:2]] == ["window 1024", "window 1537"]  # 1024 + 513 pool slots
    assert all("aten::linear" in s for s in steps)
    linears = [int(s.split("aten::linear ")[1].split(";")[0].split(" x")[1]) for s in steps[6:]]
    layers = 2  # the tiny draft's: q, k, v, o, gate, up, down a layer, then lm_head; merged, 3 fewer a layer
    assert linears == [7 * layers + 1] * 2 + [(7 - 3) * layers + 1] * 2, steps[6:]
    assert "head half" not in out  # --draft-only


def test_head_compile_compares_every_variant_of_both_halves_on_the_cpu():
    """bench/head_compile.py --tiny runs the probe's code on the CPU (nothing measured there): a row
    per variant and half, the whole forward compiled twice to the same bits, and close to the plain
    forward's (float32 here)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "bench" / "head_compile.py"), "--tiny", "--tail", "--calls", "1"],
                         capture_output=True, text=True, check=True, timeout=600, cwd=root).stdout
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| tiny")]
    assert [r[:2] for r in rows] == [[half, v] for half in ("tiny head half (with the embedding)", "tiny tail half")
                                     for v in ("plain (the product's default)", "attention compiled",
                                               "whole forward compiled", "whole forward compiled, again")]
    assert [r[5] for r in rows] == ["", "", "", "True"] * 2
    assert all(float(r[4]) < 1e-4 for r in rows)


def test_live_bench_runs_the_reference_at_the_first_rtt_only_when_asked():
    from live_report import modes_at

    modes = ["none", "chain", "auto"]
    assert modes_at(modes, 0, [0, 86], True) == modes
    assert modes_at(modes, 86, [0, 86], True) == ["chain", "auto"]
    assert modes_at(modes, 86, [0, 86], False) == modes
    assert modes_at(["chain"], 0, [0], True) == ["chain"]


def test_live_bench_refuses_a_prompt_count_the_real_pairs_kinds_do_not_divide(tmp_path):
    import subprocess

    got = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "bench" / "live_bench.py"), "--pair", str(tmp_path), "--prompts", "6"],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 2 and "--prompts with --pair: a multiple of 4" in got.stderr


def test_pipeline_sim_runs_auto_with_the_policys_constants_set_for_one_mode_only():
    from pipeline_sim import policy_modes, with_policy

    from sfchat.engine import policy

    sets = policy_modes(["auto-4s=RETRIAL_SHARE:1,TRIAL_VERDICTS:5"])
    assert sets == {"auto-4s": {"RETRIAL_SHARE": 1.0, "TRIAL_VERDICTS": 5}}
    assert isinstance(sets["auto-4s"]["TRIAL_VERDICTS"], int)
    before = (policy.RETRIAL_SHARE, policy.TRIAL_VERDICTS)
    with with_policy(sets["auto-4s"]):
        assert (policy.RETRIAL_SHARE, policy.TRIAL_VERDICTS) == (1.0, 5)
    assert (policy.RETRIAL_SHARE, policy.TRIAL_VERDICTS) == before
    for bad in ["auto-x=NO_SUCH:1", "auto-x=RETRIAL_SHARE", "auto-x=RETRIAL_SHARE:abc"]:
        with pytest.raises(SystemExit, match="--policy"):
            policy_modes([bad])


def test_live_bench_removes_its_checkpoints_when_it_ends_or_is_terminated(tmp_path):
    """A 7B pair's checkpoints are ~16 GB: runs one after another (each cut short by ``timeout``'s
    SIGTERM or not) must not leave them behind to fill the disk."""
    import os
    import signal
    import subprocess

    root = Path(__file__).resolve().parents[1]
    code = ("import sys, time; sys.path.insert(0, 'bench'); import live_bench; d = live_bench.scratch_dir(); "
            "(d / 'weights').write_bytes(b'x' * 1000); print(d, flush=True); time.sleep(float(sys.argv[1]))")
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", code, "0"], cwd=root, env=env, capture_output=True, text=True,
                          check=True, timeout=300)
    assert Path(done.stdout.strip()).parent == tmp_path and not Path(done.stdout.strip()).exists()
    proc = subprocess.Popen([sys.executable, "-c", code, "600"], cwd=root, env=env, stdout=subprocess.PIPE, text=True)
    made = Path(proc.stdout.readline().strip())
    assert (made / "weights").stat().st_size == 1000
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    assert list(tmp_path.iterdir()) == []
    # found on the GPU: a reply ended just as ``timeout`` struck, and its SIGTERM came while the
    # folder was being removed: the handler's exit stopped the removal half done
    late = ("import os, signal, sys; sys.path.insert(0, 'bench'); import live_bench; d = live_bench.scratch_dir()\n"
            "for i in range(3): (d / f'shard{i}').write_bytes(b'x' * 1000)\n"
            "real = os.unlink\n"
            "def unlink(*a, **kw):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    return real(*a, **kw)\n"
            "os.unlink = unlink\n")
    late_run = subprocess.run([sys.executable, "-c", late], cwd=root, env=env, capture_output=True, text=True,
                              timeout=300)
    assert list(tmp_path.iterdir()) == [], late_run.stderr
    assert "Traceback" not in late_run.stderr


def test_stretch_difficulty_gives_each_stretch_the_ranks_of_the_tokens_it_committed(tmp_path, capsys):
    """bench/stretch_difficulty.py: a saved synthetic run's verdicts, cut into stretches, each with
    the share of its committed tokens the draft proposed first (known per token) and its rate."""
    import json

    import torch
    from live_bench import draw_ranks, prompts_for
    from stretch_difficulty import main

    vocab, hist = 1000, [1, 0, 1]  # rank 0 or not proposed (the last), evenly
    (tmp_path / "ranks.json").write_text(json.dumps(hist))
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234)).tolist()
    rank = draw_ranks(hist, vocab)
    prompts, ids, rows = prompts_for(None, True, 2), [], []
    for p in prompts:  # 20 tokens a reply, a verdict each: 10 ms where the draft proposed it first, else 30
        t, reply = p[-1], []
        for _ in range(20):
            rows.append(["stream", 1, 0.5, 4, 86.0, 3.0, 10.0 if rank[t] == 0 else 30.0, 1.0, 1.0, 900, 2, 0, 0.0])
            t = perm[t]
            reply.append(t)
        ids.append(reply)
    fields = ["schedule", "committed", "expected", "in_flight", "rtt_ms", "tail_ms", "round_ms", "draft_ms", "head_ms",
              "forward_bytes", "draft_steps", "ahead_steps", "wait_ms"]
    run = tmp_path / "run.json"
    run.write_text(json.dumps([{"mode": "stream", "rtt": 86, "ids": ids, "per_verdict": {"fields": fields, "rows": rows}}]))
    assert main([str(run), "--stretch", "5", "--skip", "0", "--vocab", str(vocab), "--ranks", str(tmp_path / "ranks.json")]) == 0
    out = capsys.readouterr().out
    table, summary = out.split("\n\n")
    got = [line.split(" | ")[2:] for line in table.splitlines() if line.startswith("| 86 | stream | ")]
    want = []
    for reply, p in enumerate(prompts):
        seq = [p[-1]] + ids[reply]
        for a in range(0, 20, 5):
            firsts = sum(rank[t] == 0 for t in seq[a:a + 5])
            want.append([str(reply + 1), f"{firsts / 5:.2f}", f"{5 / (10 * firsts + 30 * (5 - firsts)):.4f} |"])
    assert got == want
    summary = [line for line in summary.splitlines() if line.startswith("| 86 | stream | 8 |")]
    cells = summary[0].split(" | ") if len(summary) == 1 else []
    assert len(cells) == 8 and float(cells[5]) > 0.9 and float(cells[7].rstrip(" |")) < float(cells[6])
    ids[0][3] = perm[ids[0][3]]  # a reply the synthetic target did not write
    run.write_text(json.dumps([{"mode": "stream", "rtt": 86, "ids": ids, "per_verdict": {"fields": fields, "rows": rows}}]))
    assert main([str(run), "--vocab", str(vocab), "--ranks", str(tmp_path / "ranks.json")]) == 2
    assert "its replies are not the synthetic target's" in capsys.readouterr().err


def test_the_simulators_rank_seed_picks_another_synthetic_text(zoo, monkeypatch):
    """pipeline_sim --rank-seed: the synthetic draft's ranks per token (how easy each token is for
    it) come from ``live_bench.RANK_SEED`` when the drafter is made; 7, live_bench's own, by default."""
    import live_bench
    import torch

    from sfchat.model.slices import ModelSlice
    from sfchat.model.source import ModelSource

    src = ModelSource.open(str(zoo["draft"]))
    model = ModelSlice.load(src, 0, src.config.num_hidden_layers, embed=True, head=True, dtype=torch.float32,
                            device=torch.device("cpu"), max_len=64)
    vocab = src.config.vocab_size
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))
    made = live_bench.SyntheticDrafter(model, width=8, children=8, pool=17, perm=perm, ranks=RANKS)
    monkeypatch.setattr(live_bench, "RANK_SEED", 3)
    other = live_bench.SyntheticDrafter(model, width=8, children=8, pool=17, perm=perm, ranks=RANKS)
    assert made.rank == draw_ranks(RANKS, vocab) == draw_ranks(RANKS, vocab, 7)
    assert other.rank == draw_ranks(RANKS, vocab, 3) != made.rank
