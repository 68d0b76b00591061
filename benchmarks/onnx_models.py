"""Whole-model ONNX exports side by side in onnxruntime (CPU), one run (issues 34 and 47,
docs/export.md):

- ``fp32`` / ``q4``: `deltarule.onnx.export.export_model` with ``dtype=["fp32", "q4"]`` (target ort:
  com.microsoft.LinearAttention and CausalConvWithState nodes; q4 through onnxruntime's
  weight-only quantizer at onnxruntime-genai's int4 defaults), from one trace;
- ``q4-last``: the q4 export with ``num_logits_to_keep`` (prefill computes the last
  position's logits only; onnxruntime-genai cannot feed that input, transformers.js does);
- ``scan`` (``--scan``): the fp32 model with every linear-attention node as
  ``ai.deltarule::LinearAttention`` run through its ONNX function body (a ``Scan`` over tokens:
  what the first public exports of these models did), from the opset-27 export;
- ``genai-fp32`` / ``genai-int4``: onnxruntime-genai's own model builder (``python -m
  onnxruntime_genai.models.builder -p fp32 | int4 -e cpu``) on the same checkpoint, when
  onnxruntime_genai is installed (``.venv-genai``: bash .ci/genai install).

Each on a random-weight Qwen3.5 checkpoint (`deltarule.tools.bench.checkpoints`: ``tiny`` and the
Qwen3.5-0.8B shape), batch 1: prefill tokens/s of a prompt of each length from zero state (the
last position's logits asked for: a model without ``num_logits_to_keep`` computes them all),
and decode tokens/s (one token after a past of that length). Timed with
`deltarule.tools.bench.timing.interleaved` (each implementation warmed up 0.1 s, then rounds of one
>= 10 ms batch each, order rotated round to round, 20 ms pause before each batch);
onnxruntime's default intra-op threads (one per core). Ratios (deltarule's speed over the
other's): medians of per-round ratios, [min-max] over the rounds. Copy bandwidth measured in the
same run; file sizes printed.

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

from deltarule.tools.bench import checkpoints, copy_bandwidth
from deltarule.tools.bench.timing import interleaved
from deltarule.onnx.export import export_model as export_onnx
from deltarule.onnx.export.generate import DecoderSession
from deltarule.onnx import custom_op as deltarule_ops


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


def genai_builder(checkpoint: str, out: str, precision: str = "fp32") -> str | None:
    """onnxruntime-genai's builder on `checkpoint` (``-p precision``, CPU); None when it is not
    installed.

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
                        "-p", precision, "-e", "cpu", "-c", os.path.join(out, "cache")], check=True)
    return os.path.join(out, "model.onnx")


def agree(sessions: dict, vocab: int) -> dict:
    """Each session's prefill logits (16 tokens) against its float reference's (genai's against
    deltarule's fp32): relative max error."""
    ids = np.random.default_rng(1).integers(3, vocab, (1, 16), dtype=np.int64)
    mask = np.ones((1, 16), np.int64)
    logits = {name: s.step(ids, mask, s.zero_state(1))[0].astype(np.float64) for name, s in sessions.items()}
    ref = logits["fp32"]
    return {name: float(np.abs(x - ref).max() / np.abs(ref).max()) for name, x in logits.items()}


def _prefill(session: DecoderSession, T: int, vocab: int):
    ids = np.random.default_rng(0).integers(3, vocab, (1, T), dtype=np.int64)
    mask, past = np.ones((1, T), np.int64), session.zero_state(1)
    return lambda: session.step(ids, mask, past, keep_logits=1)


def _decode(session: DecoderSession, T: int, vocab: int):
    ids = np.random.default_rng(0).integers(3, vocab, (1, T), dtype=np.int64)
    _, past = session.step(ids, np.ones((1, T), np.int64), session.zero_state(1), keep_logits=1)
    token, mask = ids[:, -1:], np.ones((1, T + 1), np.int64)
    return lambda: session.step(token, mask, past)


# (ours, theirs): the ratios printed, where both were timed
PAIRS = (("fp32", "genai-fp32"), ("q4", "genai-int4"), ("q4-last", "genai-int4"), ("fp32", "scan"))


def _spread(ratios: list) -> str:
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=("tiny", "qwen3_5_0_8b"),
                        help="tiny: the tiny shape with a 512-token vocabulary (at 256 onnxruntime-genai's "
                             "builder takes a projection of that width for the LM head)")
    parser.add_argument("--prompt", action="append", type=int)
    parser.add_argument("--workdir", default=".onnx-models")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per implementation and case")
    parser.add_argument("--scan", action="store_true", help="also time the Scan twin (fp32)")
    args = parser.parse_args(argv)
    shapes, prompts = args.shape or ["tiny"], args.prompt or [16, 1024]
    bandwidth = copy_bandwidth()
    print(f"# onnxruntime CPU, {os.cpu_count()} cores, {platform.processor() or platform.machine()}; "
          f"copy bandwidth {bandwidth:.1f} GB/s")
    for shape in shapes:
        root = os.path.join(args.workdir, shape)
        vocab = 512 if shape == "tiny" else None
        ck = checkpoints.save("qwen3_5", os.path.join(root, "checkpoint"), shape=shape, vocab_size=vocab)
        vocab = checkpoints.config("qwen3_5", shape, vocab_size=vocab).vocab_size
        ours = os.path.join(root, "deltarule", "onnx")
        if not os.path.isfile(os.path.join(ours, "model_q4.onnx")):
            export_onnx(ck, os.path.join(root, "deltarule"), dtype=["fp32", "q4"], overwrite=True)
        last = os.path.join(root, "deltarule-last", "onnx", "model_q4.onnx")
        if not os.path.isfile(last):
            export_onnx(ck, os.path.join(root, "deltarule-last"), dtype="q4", num_logits_to_keep=True, overwrite=True)
        files = {"fp32": os.path.join(ours, "model.onnx"), "q4": os.path.join(ours, "model_q4.onnx"), "q4-last": last}
        if args.scan:
            standard = os.path.join(root, "opset27", "onnx", "model.onnx")
            if not os.path.isfile(standard):
                export_onnx(ck, os.path.join(root, "opset27"), target="onnx", overwrite=True)
            files["scan"] = scan_variant(standard)
        sessions = {name: DecoderSession(path) for name, path in files.items()}
        head_dim = checkpoints.config("qwen3_5", shape).head_dim
        for precision in ("fp32", "int4"):
            builder = genai_builder(ck, os.path.join(root, f"genai-{precision}"), precision)
            if builder:
                files[f"genai-{precision}"] = builder
                sessions[f"genai-{precision}"] = DecoderSession(builder, sizes={"kv_cache_dim": head_dim})
        print(f"{shape}: file bytes (with external data): " + ", ".join(
            f"{name} {_bytes(path) / 1e6:.1f} MB" for name, path in files.items() if name != "scan"), flush=True)
        errors = agree(sessions, vocab)
        print(f"{shape}: prefill logits vs deltarule's fp32 export, relative max error: "
              + ", ".join(f"{name} {e:.1e}" for name, e in errors.items() if name != "fp32"), flush=True)
        for name in ("scan", "genai-fp32"):
            if name in errors and errors[name] > 1e-3:        # a graph computing something else is not timed
                print(f"{shape}: {name} disagrees ({errors[name]:.1e}): not timed", flush=True)
                del sessions[name]
        names = list(sessions)
        pairs = [(a, b) for a, b in PAIRS if a in sessions and b in sessions]
        print(f"| shape | prompt | phase | {' | '.join(n + ' tok/s' for n in names)} | "
              + " | ".join(f"{a} / {b}" for a, b in pairs) + " |")
        print("|---" * (3 + len(names) + len(pairs)) + "|")
        for T in prompts:
            for phase, make in (("prefill", _prefill), ("decode", _decode)):
                fns = {name: make(s, T, vocab) for name, s in sessions.items()}
                timings = interleaved(fns, args.rounds, args.budget)
                tokens = T if phase == "prefill" else 1
                rates = [f"{tokens / timings[n].median:.1f}" for n in names]
                ratios = [_spread(timings[b].ratios(timings[a])) for a, b in pairs]
                print("| " + " | ".join([shape, str(T), phase, *rates, *ratios]) + " |", flush=True)
    return 0


def _bytes(path: str) -> int:
    """A model file's bytes with its external data (deltarule's ``<file>_data``, genai's ``<file>.data``)."""
    return os.path.getsize(path) + sum(os.path.getsize(path + s) for s in ("_data", ".data") if os.path.isfile(path + s))


if __name__ == "__main__":
    sys.exit(main())
