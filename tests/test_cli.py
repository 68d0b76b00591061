"""The `deltarule` command: info and check (bench has tests/test_bench.py)."""

import subprocess
import sys

import pytest
import torch

from deltarule.cli import main


def test_info_lists_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "reference" in out and "rules:" in out


def test_info_lists_library_versions_and_whether_tested(capsys, monkeypatch):
    import importlib.metadata

    from deltarule import versions

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
    import deltarule.peers as peers

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
    assert "no test.json case matches --case 'nosuchcase'" in capsys.readouterr().err


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
