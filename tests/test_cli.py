"""The `deltarule` command: info and check (bench has tests/test_bench.py)."""

import subprocess
import sys

from deltarule.cli import main


def test_info_lists_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "reference" in out and "rules:" in out


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
    import deltarule.peers as peers

    def missing(*args, **kwargs):
        raise peers.PeerMissing("onnxruntime is not installed")

    monkeypatch.setattr(peers, "run_onnx_node", missing)
    main(["check", "--backend", "torch", "--case", "slab-all-padding", "--peers"])
    assert "skipped: onnxruntime is not installed" in capsys.readouterr().out


def test_check_reports_declined_calls(capsys, monkeypatch):
    """A backend that declines a valid call is listed as declined, neither passed nor failed."""
    from deltarule import Unsupported
    from deltarule.backends import REGISTRY

    def decline(p):
        raise Unsupported("not this one")

    monkeypatch.setattr(REGISTRY["torch"], "run", decline)
    assert main(["check", "--backend", "torch", "--case", "slab-all-padding"]) == 0
    out = capsys.readouterr().out
    assert "declined: not this one" in out and "0 passed, 0 failed, 1 declined" in out
