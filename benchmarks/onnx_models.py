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
(each implementation warmed up 0.1 s, then rounds of one >= 10 ms batch each, order rotated
round to round, 20 ms pause before each batch); onnxruntime's default intra-op threads (one
per core). Ratios: medians of per-round ratios, [min-max] over the rounds. Copy bandwidth
measured in the same run.

    .venv-genai/bin/python benchmarks/onnx_models.py --shape tiny --shape qwen3_5_0_8b --prompt 16 --prompt 1024
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

import numpy as np
import onnx

from deltarule.bench import checkpoints, copy_bandwidth
from deltarule.bench.timing import interleaved
from deltarule.export import onnx as export_onnx
from deltarule.export.generate import DecoderSession
from deltarule.onnx import ops as deltarule_ops


def scan_variant(export: str, out: str | None = None) -> str:
    """An export (either target) with its LinearAttention nodes as ai.deltarule::LinearAttention's
    function body inlined (a Scan over tokens per layer: the node's signature is the same in
    both targets), saved to `out` (default ``model_scan.onnx`` beside it, sharing its external
    weights file)."""
    model = onnx.load(export, load_external_data=False)
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx", "com.microsoft") and node.op_type == "LinearAttention":
            node.domain = deltarule_ops.DOMAIN
    model = deltarule_ops.expand(model)            # the function bodies inlined: a Scan per layer
    out = out or os.path.join(os.path.dirname(export), "model_scan.onnx")
    onnx.save_model(model, out)
    return out


def genai_builder(checkpoint: str, out: str) -> str | None:
    """onnxruntime-genai's builder on `checkpoint` (fp32, CPU); None when it is not installed.

    The builder takes Qwen3.5 only as ``Qwen3_5ForConditionalGeneration`` and checks that
    ``mrope_section`` sums to half the rotary dimension (the tiny shape's [11, 11, 10] does not):
    it gets a copy of the config with both set (for text the three position rows are equal,
    so the model computes the same)."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return None
    if not os.path.isfile(os.path.join(out, "model.onnx")):
        source = os.path.join(out, "checkpoint")
        os.makedirs(source, exist_ok=True)
        for name in os.listdir(checkpoint):
            if not os.path.exists(os.path.join(source, name)):
                os.symlink(os.path.abspath(os.path.join(checkpoint, name)), os.path.join(source, name))
        with open(os.path.join(checkpoint, "config.json")) as f:
            config = json.load(f)
        config["architectures"] = ["Qwen3_5ForConditionalGeneration"]
        rope = config["rope_parameters"]
        half = int(config["head_dim"] * rope["partial_rotary_factor"]) // 2
        rope["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
        os.remove(os.path.join(source, "config.json"))
        with open(os.path.join(source, "config.json"), "w") as f:
            json.dump(config, f)
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", source, "-o", out,
                        "-p", "fp32", "-e", "cpu", "-c", os.path.join(out, "cache")], check=True)
    return os.path.join(out, "model.onnx")


def agree(sessions: dict, vocab: int) -> dict:
    """Each session's prefill logits (16 tokens) against deltarule's: relative max error."""
    ids = np.random.default_rng(1).integers(3, vocab, (1, 16), dtype=np.int64)
    mask = np.ones((1, 16), np.int64)
    logits = {name: s.step(ids, mask, s.zero_state(1))[0] for name, s in sessions.items()}
    ref = logits["deltarule"]
    return {name: float(np.abs(x - ref).max() / np.abs(ref).max()) for name, x in logits.items()}


def _prefill(session: DecoderSession, T: int, vocab: int):
    ids = np.random.default_rng(0).integers(3, vocab, (1, T), dtype=np.int64)
    mask, past = np.ones((1, T), np.int64), session.zero_state(1)
    return lambda: session.step(ids, mask, past)


def _decode(session: DecoderSession, T: int, vocab: int):
    ids = np.random.default_rng(0).integers(3, vocab, (1, T), dtype=np.int64)
    _, past = session.step(ids, np.ones((1, T), np.int64), session.zero_state(1))
    token, mask = ids[:, -1:], np.ones((1, T + 1), np.int64)
    return lambda: session.step(token, mask, past)


def _row(shape: str, T: int, phase: str, rate: dict, ratios: dict) -> str:
    """A table row: tokens/s of each implementation, and deltarule's speed over the others'
    (their time / deltarule's per round: the median, [min-max] over rounds); "-" where one was
    not timed."""
    rates = [f"{rate[n]:.1f}" if n in rate else "-" for n in ("scan", "genai")]
    spread = [f"{statistics.median(ratios[n]):.2f}x [{min(ratios[n]):.2f}-{max(ratios[n]):.2f}]" if n in ratios
              else "-" for n in ("scan", "genai")]
    return "| " + " | ".join([shape, str(T), phase, f"{rate['deltarule']:.1f}", *rates, *spread]) + " |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=("tiny", "qwen3_5_0_8b"),
                        help="tiny: the tiny shape with a 512-token vocabulary (at 256 onnxruntime-genai's "
                             "builder takes a projection of that width for the LM head)")
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
        vocab = 512 if shape == "tiny" else None
        ck = checkpoints.save("qwen3_5", os.path.join(root, "checkpoint"), shape=shape, vocab_size=vocab)
        vocab = checkpoints.config("qwen3_5", shape, vocab_size=vocab).vocab_size
        ours = os.path.join(root, "deltarule", "onnx", "model.onnx")
        if not os.path.isfile(ours):
            export_onnx(ck, os.path.join(root, "deltarule"), overwrite=True)
        standard = os.path.join(root, "opset27", "onnx", "model.onnx")
        if not os.path.isfile(standard):
            export_onnx(ck, os.path.join(root, "opset27"), target="onnx", overwrite=True)
        scan = scan_variant(standard)
        sessions = {"deltarule": DecoderSession(ours), "scan": DecoderSession(scan)}
        builder = genai_builder(ck, os.path.join(root, "genai"))
        if builder:
            head_dim = checkpoints.config("qwen3_5", shape).head_dim
            sessions["genai"] = DecoderSession(builder, sizes={"kv_cache_dim": head_dim})
        errors = agree(sessions, vocab)
        print(f"{shape}: prefill logits vs deltarule's export, relative max error: "
              + ", ".join(f"{name} {e:.1e}" for name, e in errors.items() if name != "deltarule"), flush=True)
        for name, e in errors.items():
            if e > 1e-3:                                   # a graph computing something else is not timed
                print(f"{shape}: {name} disagrees ({e:.1e}): not timed", flush=True)
                del sessions[name]
        for T in prompts:
            for phase, make in (("prefill", _prefill), ("decode", _decode)):
                fns = {name: make(s, T, vocab) for name, s in sessions.items()}
                timings = interleaved(fns, args.rounds, args.budget)
                tokens = T if phase == "prefill" else 1
                rate = {name: tokens / t.median for name, t in timings.items()}
                ratio = {name: timings[name].ratios(timings["deltarule"]) for name in timings if name != "deltarule"}
                print(_row(shape, T, phase, rate, ratio), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
