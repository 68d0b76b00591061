"""The `deltarule` command: info and check (bench has tests/test_bench.py)."""

import subprocess
import sys

import pytest
import torch

from deltarule.tools.cli import main


def test_info_lists_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "reference" in out and "rules:" in out


def test_info_lists_library_versions_and_whether_tested(capsys, monkeypatch):
    import importlib.metadata

    from deltarule.tools import versions

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("transformers", "kernels", "vllm", "onnxruntime", "fla", "triton"):
        assert f"\n  {name} " in out, name
    real = importlib.metadata.version
    fake = {"transformers": "9.9.9", "kernels": None}

    def version(distribution):
        if distribution in fake:
            if fake[distribution] is None:
                raise importlib.metadata.PackageNotFoundError(distribution)
            return fake[distribution]
        return real(distribution)

    monkeypatch.setattr(importlib.metadata, "version", version)
    rows = {name: (version, tested) for name, _, version, tested in versions.installed()}
    assert rows["transformers"] == ("9.9.9", False) and rows["kernels"] == (None, False)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "transformers 9.9.9" in out and "NOT a tested release" in out and "kernels       not installed" in out


def test_check_prints_a_table_and_passes(capsys):
    assert main(["check", "--backend", "torch", "--case", "slab-", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "slab-all-padding" in out and "FAIL" not in out
    assert "backend torch: 6 passed, 0 failed, 0 declined" in out     # slab-B3.., slab-bf16.., ..


def test_check_fails_on_a_wrong_backend_result(capsys, monkeypatch):
    """The check must be able to fail: a backend that perturbs its output is caught."""
    from deltarule.backends import REGISTRY
    torch_backend = REGISTRY["torch"]
    real_run = torch_backend.run

    def off_by_a_little(p):
        o, s = real_run(p)
        return o * (1 + 1e-3), s

    monkeypatch.setattr(torch_backend, "run", off_by_a_little)
    assert main(["check", "--backend", "torch", "--case", "gdn-B2-T63", "--dtype", "float32"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "deltarule", "info"], capture_output=True, text=True, check=True)
    assert "reference" in out.stdout


def test_check_peers_compares_adapters_with_their_runtimes(capsys):
    import pytest
    pytest.importorskip("onnxruntime", reason="the peer runtime onnxruntime is not installed")
    assert main(["check", "--backend", "torch", "--case", "slab-all-padding", "--peers"]) == 0
    out = capsys.readouterr().out
    assert "ort.GatedDeltaNet" in out and "onnx.LinearAttention-27" in out and "FAIL" not in out


def test_check_peers_reports_a_missing_runtime_as_skipped(capsys, monkeypatch):
    import deltarule.tools.oracles as peers

    def missing(*args, **kwargs):
        raise peers.PeerMissing("onnxruntime is not installed")

    monkeypatch.setattr(peers, "run_onnx_node", missing)
    main(["check", "--backend", "torch", "--case", "slab-all-padding", "--peers"])
    assert "skipped: onnxruntime is not installed" in capsys.readouterr().out


def test_check_reports_declined_calls(capsys, monkeypatch):
    """A backend that declines a valid call is listed as declined, neither passed nor failed;
    when it declines every call nothing was checked, and that is not a pass."""
    from deltarule import Unsupported
    from deltarule.backends import REGISTRY

    def decline(p):
        raise Unsupported("not this one")

    monkeypatch.setattr(REGISTRY["torch"], "run", decline)
    assert main(["check", "--backend", "torch", "--case", "slab-all-padding"]) == 1
    out, err = capsys.readouterr()
    assert "declined: not this one" in out and "0 passed, 0 failed, 1 declined" in out
    assert "nothing was checked" in err


def test_check_with_no_matching_case_fails(capsys):
    assert main(["check", "--case", "nosuchcase"]) == 2
    assert_one_line(capsys.readouterr().err, "deltarule check: --case: ",
                    "--case 'nosuchcase' (no test.json case matches)")


def test_check_with_no_case_of_the_dtype_fails_naming_dtype(capsys, monkeypatch):
    """slab-* cases list float32 and bfloat16 only: --dtype float16 selects nothing, before any call."""
    from deltarule.tools import check

    monkeypatch.setattr(check, "compare", _must_not_run("check.compare"))
    assert main(["check", "--case", "slab-", "--dtype", "float16"]) == 2
    assert_one_line(capsys.readouterr().err, "deltarule check: --dtype: ", "(bfloat16, float32)", "'float16'")


def test_check_of_a_backend_unavailable_here_fails_saying_why(capsys, monkeypatch):
    """`check --backend triton` on a machine without triton ran nothing and exited 0."""
    from deltarule.backends import REGISTRY

    monkeypatch.setattr(REGISTRY["triton"], "unavailable", lambda: "triton is not installed: pip install triton")
    assert main(["check", "--backend", "triton", "--case", "slab-all-padding"]) == 1
    assert "'triton' is not available on this machine: triton is not installed: pip install triton" \
        in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--backend", "cuda"], "argument --backend: invalid choice: 'cuda'"),
    (["--device", "cuda"], "argument --device: no CUDA device 'cuda' on this machine"),
    (["--device", "nosuchdevice"], "argument --device: not a torch device: 'nosuchdevice'"),
])
def test_check_rejects_a_bad_backend_or_device_like_bench(argv, message, capsys, monkeypatch):
    """Usage errors (exit status 2, argparse's message), not a traceback from the first call."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)      # also on a machine with a GPU
    with pytest.raises(SystemExit) as e:
        main(["check", *argv, "--case", "slab-all-padding"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_every_backend_says_why_it_is_unavailable(monkeypatch):
    """available() is `unavailable() is None`; each reason says what is missing and how to get it."""
    import sys

    from deltarule.backends import REGISTRY, cpu_backend, triton_backend
    from deltarule.kernels.cpu import recurrent as cpu_recurrent

    for m in REGISTRY.values():
        assert m.available() == (m.unavailable() is None), m.NAME
    monkeypatch.setattr(cpu_recurrent, "available", lambda: False)
    assert "no C compiler" in cpu_backend.unavailable() and "pip install" in cpu_backend.unavailable()
    assert not cpu_backend.available()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device and TRITON_INTERPRET=1 not set" in triton_backend.unavailable()
    monkeypatch.setitem(sys.modules, "triton", None)                  # `import triton` raises ImportError
    assert triton_backend.unavailable() == "triton is not installed: pip install triton"


def test_info_and_dispatch_say_why_a_backend_is_unavailable(capsys, monkeypatch):
    from deltarule import Unsupported, linear_attention
    from deltarule.backends import REGISTRY

    why = "triton is not installed: pip install triton"
    monkeypatch.setattr(REGISTRY["triton"], "unavailable", lambda: why)
    assert main(["info"]) == 0
    assert why in capsys.readouterr().out
    q = torch.randn(1, 3, 1, 4)
    with pytest.raises(Unsupported, match=f"not available on this machine: {why}"):
        linear_attention(q, q, q, rule="linear", backend="triton")


# --- user errors: one line `deltarule <command>: <message>` on stderr, exit status 2, no traceback ---


def assert_one_line(err: str, *needles: str) -> None:
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


def _must_not_run(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran: the arguments were to be checked first")
    return fail


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_card_export_into_a_file_is_a_user_error_and_writes_nothing(where, tmp_path, capsys, monkeypatch):
    import deltarule.cards as cards

    monkeypatch.setattr(cards, "fixtures", None)         # building a card's files would fail: nothing may be built
    blocker = tmp_path / "notes.txt"
    blocker.write_text("keep me")
    target = blocker if where == "a file" else blocker / "cards"
    assert main(["card", "export", str(target)]) == 2
    assert_one_line(capsys.readouterr().err, "deltarule card export: DIR: expected a writable folder",
                    repr(str(target)), "file, not a folder")
    assert blocker.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_card_export_library_call_checks_its_directory_first(tmp_path, monkeypatch):
    """`deltarule.cards.export` itself (not only the CLI) refuses a file, a path under a file, a card's
    folder that is a file, and an unknown card id, before writing anything."""
    import deltarule.cards as cards
    from deltarule import ContractError

    monkeypatch.setattr(cards, "fixtures", None)         # building a card's files would fail: nothing may be built
    blocker = tmp_path / "notes.txt"
    blocker.write_text("")
    for directory in (blocker, blocker / "cards"):
        with pytest.raises(ContractError, match=r"^directory: expected a writable folder"):
            cards.export(str(directory))
    with pytest.raises(ContractError, match=r"^only: .*'com.microsoft.Nope'"):
        cards.export(str(tmp_path / "out"), only=["com.microsoft.Nope"])
    assert not (tmp_path / "out").exists()
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "deltarule.LinearAttention").write_text("a file where a card folder goes")
    with pytest.raises(ContractError, match="deltarule.LinearAttention is a file"):
        cards.export(str(occupied))
    assert sorted(p.name for p in occupied.iterdir()) == ["deltarule.LinearAttention"]


def test_card_export_of_a_card_folder_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "com.microsoft.LinearAttentionGate").write_text("")
    assert main(["card", "export", str(tmp_path), "--only", "com.microsoft.LinearAttentionGate"]) == 2
    assert_one_line(capsys.readouterr().err, "deltarule card export: directory: ",
                    "com.microsoft.LinearAttentionGate is a file")


def test_card_export_still_writes_into_a_new_nested_folder(tmp_path, capsys):
    target = tmp_path / "a" / "b"
    assert main(["card", "export", str(target), "--only", "com.microsoft.LinearAttentionGate"]) == 0
    assert capsys.readouterr().out.strip() == str(target / "com.microsoft.LinearAttentionGate")
    assert (target / "com.microsoft.LinearAttentionGate" / "metadata.json").is_file()


@pytest.mark.parametrize("error", ["contract", "unsupported"])
def test_export_onnx_prints_the_exporters_user_errors_as_one_line(error, tmp_path, capsys, monkeypatch):
    """The exporter's own ContractError / Unsupported (even a message of several lines) is one line."""
    import deltarule.onnx.export as export
    from deltarule import ContractError, Unsupported

    def onnx(model_dir, out_dir, **kwargs):
        if error == "contract":
            raise ContractError("model_dir", "a checkpoint folder", "nowhere\n(see docs/export.md)")
        raise Unsupported("layer 3: no fused form\nfor this cache")

    monkeypatch.setattr(export, "export_model", onnx)
    assert main(["export", "onnx", str(tmp_path / "model"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    if error == "contract":
        assert_one_line(err, "deltarule export onnx: model_dir: expected a checkpoint folder, got nowhere (see docs")
    else:
        assert_one_line(err, "deltarule export onnx: layer 3: no fused form for this cache")


def test_export_onnx_checks_out_dir_before_exporting(tmp_path, capsys, monkeypatch):
    import deltarule.onnx.export as export

    monkeypatch.setattr(export, "export_model", _must_not_run("export.export_model"))
    blocker = tmp_path / "out.onnx"
    blocker.write_text("")
    for out_dir in (blocker, blocker / "sub"):
        assert main(["export", "onnx", str(tmp_path), str(out_dir)]) == 2
        assert_one_line(capsys.readouterr().err, "deltarule export onnx: OUT_DIR: expected a writable folder",
                        repr(str(out_dir)), "file, not a folder")


def test_every_subcommand_reports_user_errors_through_one_handler(capsys, monkeypatch):
    """info too: a typed user error raised anywhere under a subcommand is one line with its name."""
    import deltarule.backends
    from deltarule import Unsupported

    def declined():
        raise Unsupported("no backends here")

    monkeypatch.setattr(deltarule.backends, "info", declined)
    assert main(["info"]) == 2
    assert_one_line(capsys.readouterr().err, "deltarule info: no backends here")


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only the typed user errors become one line: anything else is a bug and propagates."""
    import deltarule.backends

    def bug():
        raise KeyError("an internal bug")

    monkeypatch.setattr(deltarule.backends, "info", bug)
    with pytest.raises(KeyError, match="an internal bug"):
        main(["info"])


def test_usage_errors_exit_2_without_a_traceback(capsys, monkeypatch):
    """argparse's usage errors (exit status 2, a usage line and the error) for each subcommand."""
    import deltarule.tools.bench as bench
    import deltarule.cards as cards
    import deltarule.tools.check as check
    import deltarule.onnx.export as export

    for module, name in ((bench, "run"), (bench, "copy_bandwidth"), (check, "compare"), (cards, "export"),
                         (export, "export_model")):    # an option let through fails at once, not after a long run
        monkeypatch.setattr(module, name, _must_not_run(f"{module.__name__}.{name}"))
    for argv in (["bench", "--threads", "-1"], ["bench", "--repeat", "two"], ["bench", "--budget", "nan"],
                 ["bench", "--load", "-1"], ["bench", "--load", "one"],
                 ["bench", "--budget", "inf"], ["bench", "--repeat", "0"], ["bench", "--dtype", "float64"],
                 ["bench", "--model", "nope"], ["check", "--backend", "nope"], ["check", "--dtype", "float64"],
                 ["card", "export"], ["card", "export", "x", "--only", "nope"], ["export", "onnx", "m"],
                 ["export", "onnx", "m", "o", "--dtype", "int8"], ["info", "extra"], []):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and "error: " in err.splitlines()[-1], (argv, err)


def test_writable_file_and_folder(tmp_path):
    """deltarule.tools.paths: each refusal names the option and why; a writable path comes back as a str."""
    from deltarule import ContractError
    from deltarule.tools.paths import writable_file, writable_folder

    blocker = tmp_path / "file"
    blocker.write_text("")
    assert writable_file("--json", tmp_path / "new.json") == str(tmp_path / "new.json")
    assert writable_file("--json", blocker) == str(blocker)               # replaced by the writer
    assert writable_folder("DIR", tmp_path / "a" / "b" / "c") == str(tmp_path / "a" / "b" / "c")
    assert writable_folder("DIR", tmp_path) == str(tmp_path)
    for check, path, why in [
        (writable_file, tmp_path, "an existing folder"),
        (writable_file, str(tmp_path / "x") + "/", "ends in a path separator"),
        (writable_file, tmp_path / "missing" / "x.json", "no folder"),
        (writable_file, blocker / "x.json", "is a file, not a folder"),
        (writable_file, "", "an empty path"),
        (writable_folder, blocker, "an existing file"),
        (writable_folder, blocker / "a" / "b", "is a file, not a folder"),
        (writable_folder, "", "an empty path"),
    ]:
        with pytest.raises(ContractError, match="^--opt: expected a writable ") as e:
            check("--opt", path)
        assert why in str(e.value) and e.value.argument == "--opt", (path, str(e.value))
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ContractError, match="is a file, not a folder"):
        writable_folder("DIR", tmp_path / "dangling" / "sub")
