"""Whole-model ONNX exports side by side in onnxruntime (CPU), one run (issue 34, docs/export.md):

- ``deltarule``: `deltarule.export.onnx` (target ort: com.microsoft.LinearAttention and
  CausalConvWithState nodes);
- ``scan``: the same model with every linear-attention node as ``ai.deltarule::LinearAttention``
  run through its ONNX function body (a ``Scan`` over tokens: what the first public exports of
  these models did), from the opset-27 export;
- ``genai``: onnxruntime-genai's own model builder (``python -m onnxruntime_genai.models.builder``)
  on the same checkpoint, when onnxruntime_genai is installed (``.venv-genai``: bash .ci/genai install).

Each on a random-weight Qwen3.5 checkpoint (`deltarule.bench.checkpoints`: ``tiny`` and the
Qwen3.5-0.8B shape), batch 1: prefill tokens/s of a prompt of each length from zero state, and
decode tokens/s (one token after a past of that length). Timed with `deltarule.bench.timing.interleaved`
(rounds, order rotated); ratios are medians of per-round ratios. Copy bandwidth measured in
the same run.

    .venv-genai/bin/python benchmarks/onnx_models.py --shape tiny --shape qwen3_5_0_8b --prompt 16 --prompt 1024
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import onnx

from deltarule.bench import checkpoints, copy_bandwidth
from deltarule.bench.timing import interleaved
from deltarule.export import onnx as export_onnx
from deltarule.export.generate import DecoderSession
from deltarule.onnx import ops as deltarule_ops


def scan_variant(onnx_target: str, out: str) -> str:
    """The opset-27 export with its LinearAttention nodes as ai.deltarule::LinearAttention's
    function body inlined (a Scan over tokens per layer)."""
    model = onnx.load(onnx_target)
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type == "LinearAttention":
            node.domain = deltarule_ops.DOMAIN
    model = deltarule_ops.expand(model)            # the function bodies inlined: a Scan per layer
    os.makedirs(os.path.dirname(out), exist_ok=True)
    onnx.save_model(model, out, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=os.path.basename(out) + ".data", size_threshold=1024)
    return out


def genai_builder(checkpoint: str, out: str) -> str | None:
    """onnxruntime-genai's builder on `checkpoint` (fp32, CPU); None when it is not installed."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return None
    if not os.path.isfile(os.path.join(out, "model.onnx")):
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", checkpoint, "-o", out,
                        "-p", "fp32", "-e", "cpu", "-c", os.path.join(out, "cache")], check=True)
    return os.path.join(out, "model.onnx")


def _prefill(session: DecoderSession, T: int, vocab: int):
    ids = np.random.default_rng(0).integers(3, vocab, (1, T), dtype=np.int64)
    mask, past = np.ones((1, T), np.int64), session.zero_state(1)
    return lambda: session.step(ids, mask, past)


def _decode(session: DecoderSession, T: int, vocab: int):
    ids = np.random.default_rng(0).integers(3, vocab, (1, T), dtype=np.int64)
    _, past = session.step(ids, np.ones((1, T), np.int64), session.zero_state(1))
    token, mask = ids[:, -1:], np.ones((1, T + 1), np.int64)
    return lambda: session.step(token, mask, past)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=("tiny", "qwen3_5_0_8b"))
    parser.add_argument("--prompt", action="append", type=int)
    parser.add_argument("--workdir", default=".onnx-models")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per implementation and case")
    args = parser.parse_args(argv)
    shapes, prompts = args.shape or ["tiny"], args.prompt or [16, 1024]
    bandwidth = copy_bandwidth()
    print(f"# onnxruntime CPU, {os.cpu_count()} cores, {platform.processor() or platform.machine()}; "
          f"copy bandwidth {bandwidth:.1f} GB/s")
    print("| shape | prompt | phase | deltarule tok/s | scan tok/s | genai builder tok/s | deltarule / scan "
          "| deltarule / genai |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        root = os.path.join(args.workdir, shape)
        ck = checkpoints.save("qwen3_5", os.path.join(root, "checkpoint"), shape=shape)
        vocab = checkpoints.config("qwen3_5", shape).vocab_size
        ours = os.path.join(root, "deltarule", "onnx", "model.onnx")
        if not os.path.isfile(ours):
            export_onnx(ck, os.path.join(root, "deltarule"))
        standard = os.path.join(root, "opset27", "onnx", "model.onnx")
        if not os.path.isfile(standard):
            export_onnx(ck, os.path.join(root, "opset27"), target="onnx")
        scan = os.path.join(root, "scan", "model.onnx")
        if not os.path.isfile(scan):
            scan_variant(standard, scan)
        sessions = {"deltarule": DecoderSession(ours), "scan": DecoderSession(scan)}
        builder = genai_builder(ck, os.path.join(root, "genai"))
        if builder:
            sessions["genai"] = DecoderSession(builder)
        for T in prompts:
            for phase, make in (("prefill", _prefill), ("decode", _decode)):
                fns = {name: make(s, T, vocab) for name, s in sessions.items()}
                timings = interleaved(fns, args.rounds, args.budget)
                tokens = T if phase == "prefill" else 1
                rate = {name: tokens / t.median for name, t in timings.items()}
                ratio = {name: statistics.median(timings[name].ratios(timings["deltarule"]))
                         for name in timings if name != "deltarule"}
                print(f"| {shape} | {T} | {phase} | {rate['deltarule']:.1f} | {rate['scan']:.1f} | "
                      f"{rate.get('genai', float('nan')):.1f} | {ratio['scan']:.2f}x | "
                      f"{ratio['genai']:.2f}x |" if "genai" in ratio else
                      f"| {shape} | {T} | {phase} | {rate['deltarule']:.1f} | {rate['scan']:.1f} | - | "
                      f"{ratio['scan']:.2f}x | - |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
