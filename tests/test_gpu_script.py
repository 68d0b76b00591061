"""benchmarks/gpu.py, the prepared GPU check, runs end to end on CPU with --dry-run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
HEADERS = ("== environment ==", "== hbm copy bandwidth ==", "== correctness ==", "== prefill ==",
           "== decode ==", "== backward ==", "== targets ==")


def test_gpu_script_compiles():
    import py_compile

    py_compile.compile(str(SCRIPT), doraise=True)


def test_gpu_script_dry_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=55,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    positions = [out.index(h) for h in HEADERS]          # every section, in order
    assert positions == sorted(positions)
    assert "section failed" not in out
    assert "0 section(s) failed" in out
    assert " 0 failed" in out                             # correctness: nothing failed
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["correctness"]["failed"] == 0
    assert data["correctness"]["cases"]
    assert data["correctness"]["poison_active"] is True
    assert data["backward"]["failed"] == 0 and data["backward"]["timings"]
    assert all(r.get("status") == "ok" for r in data["prefill"] + data["decode"]), data["prefill"] + data["decode"]
    assert {r["kind"] for r in data["prefill"]} == {"gdn", "kda", "gdn2"}
    assert data["hbm_copy_GBps"] > 0
    assert data["targets"]
    assert (tmp_path / "gpu.md").read_text().startswith("```")


def test_gpu_script_cases_resolve():
    """Every correctness case the GPU run names exists (test.json or the script's extra cases) and
    makes valid inputs: a missing name would only print a row, never fail on the device."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu
    finally:
        sys.path.remove(str(SCRIPT.parent))
    import deltarule
    from deltarule import cases

    by_name = {c["name"]: c for c in cases.test_cases() + gpu.EXTRA_CASES}
    names = [name for name, _ in gpu.CORRECTNESS]
    assert len(set(names)) == len(names)
    assert set(names) <= set(by_name) and gpu.QUICK_CORRECTNESS <= set(names)
    for extra in gpu.EXTRA_CASES:
        assert extra["name"] in names
        deltarule.validate(**cases.make_inputs(extra))


def test_triton_kernels_compile_for_sm90():
    """The real Triton compiler (not the interpreter, which type-checks nothing) lowers the fused
    recurrence with every preprocessing arm (and the speculative variant's per-token stores into a
    bfloat16 slab) and the per-key cumsum with the raw gate for sm_90, on the CPU;
    `benchmarks/triton_aot.py` without --only compiles every variant (minutes)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "triton_aot.py"), "--only", "recurrent,cumsum",
         "--K", "32", "--V", "32"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 failure(s)" in proc.stdout
    assert proc.stdout.count(" KiB") == 7          # 2 cumsum + 5 recurrent variants
