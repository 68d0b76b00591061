"""Inputs, one-node ONNX models and float64 expectations for web/ort-kernels.html.

The page (web/ort-kernels.js, docs/web.md "The cards against onnxruntime-web's own kernels")
runs deltarule's WebGPU kernel cards and onnxruntime-web's WebGPU execution provider on the same
numbers, in the same page, on the same GPUDevice, and checks both against deltarule's float64
reference. This script writes what the page reads into OUT (default web/ort-kernels/, gitignored):

- ``index.json``: the shape (B = 1, H heads, K, V), the relative-error tolerance (deltarule's
  float32 card tolerance, ``deltarule.cards.fixtures.TOL``), the models (``ort_models``: contract,
  variant, file, attributes) and per case its tensors as ``{"file", "shape"}`` (raw float32,
  little-endian, C order);
- ``GatedDeltaNet-chunk<C>.onnx`` per ``--gdn-chunk-sizes`` C (default 16, 64): one
  ``com.microsoft.GatedDeltaNet`` node, (B, S, H, D) inputs, V-major state (B, H, V, K),
  update_rule gated_delta, ``chunk_size`` C, every other attribute at its default. chunk_size is
  a scheduling hint: onnxruntime 1.31.1's WebGPU kernel documents 16 as the opt-in to its
  chunkwise prefill "on supported Apple silicon" and 64 (the default) as its recurrent route; the
  page records which programs each session built (docs/web.md);
- ``LinearAttention.onnx``: one ``com.microsoft.LinearAttention`` node, packed (B, T, H * D)
  query / key / value, K-major ``past_state`` (B, H, K, V), update_rule gated_delta,
  q_num_heads = kv_num_heads = H, scale 0 (1 / sqrt(K), as both cards' default);
- per case ``<case>/q.f32, k.f32, v.f32, g.f32, beta.f32, s0_kv.f32, s0_vk.f32`` (inputs) and
  ``o.f32, state_kv.f32, state_vk.f32`` (the float64 reference rounded to float32 on write).

The cases: prefill from a non-zero initial state at T = 1024 and 4096 tokens, and decode: T = 1
steps with the state fed back, whose expectation is the same recurrence over the ``--decode``
tokens (per-step outputs stacked [1, steps, H, V], the state after the last step).

Inputs: q ~ N(0, 1), k ~ N(0, 1) L2-normalized per head (the delta rule's conditioning, as the
cards' tests), v ~ N(0, 1), log decay g ~ U(--decay-lo, --decay-hi), beta = sigmoid(N(0, 1)),
initial state 0.5 * N(0, 1); seeded per case.

Expectations: deltarule's float64 oracle (``deltarule.reference`` through ``check.expected``),
once through the GatedDeltaNet contract adapter (``contracts.ort.gated_delta_net_arguments``,
V-major state) and once through the LinearAttention mapping (packed [B, T, H*D] -> [B, T, H, D],
the argument mapping of ``contracts.ort.linear_attention``, K-major state); the two must agree.
``--check-ort-cpu`` also runs every model in onnxruntime's CPU provider (Python) and prints their
relative errors against it (a check of the models, not part of the page).

    .venv/bin/python benchmarks/ort_web_kernels.py --out web/ort-kernels
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import onnx
import torch

from deltarule.tools import check
from deltarule.cards.fixtures import TOL
from deltarule.contracts import ort as ort_contract
from deltarule.tools.oracles import one_node_model

def gated_delta_net_model(H: int, K: int, V: int, chunk_size: int) -> onnx.ModelProto:
    """One com.microsoft.GatedDeltaNet node: (1, S, H, D) inputs, V-major state (1, H, V, K).

    Args:
        H, K, V: heads, key and value head sizes.
        chunk_size: the node's chunk_size attribute (a scheduling hint, never the result).
    """
    f = np.float32
    return one_node_model(
        "GatedDeltaNet", [("query", f, [1, "S", H, K]), ("key", f, [1, "S", H, K]), ("value", f, [1, "S", H, V]), None,
                          ("decay", f, [1, "S", H]), ("beta", f, [1, "S", H]), ("initial_state", f, [1, H, V, K])],
        [("output", f, [1, "S", H, V]), ("final_state", f, [1, H, V, K])],
        domain="com.microsoft", opset=21, ir_version=10, update_rule="gated_delta", chunk_size=chunk_size)


def ort_models(chunk_sizes: list[int], H: int) -> list[dict]:
    """The one-node models the page runs in onnxruntime-web (H heads): GatedDeltaNet per chunk size,
    in the given order (the page warms them up in this order), then LinearAttention."""
    gdn = [{"contract": "com.microsoft.GatedDeltaNet", "variant": f"chunk_size={c}",
            "file": f"GatedDeltaNet-chunk{c}.onnx", "attributes": {"update_rule": "gated_delta", "chunk_size": c}}
           for c in chunk_sizes]
    return gdn + [{"contract": "com.microsoft.LinearAttention", "variant": "", "file": "LinearAttention.onnx",
                   "attributes": {"update_rule": "gated_delta", "q_num_heads": H, "kv_num_heads": H}}]


def linear_attention_model(H: int, K: int, V: int) -> onnx.ModelProto:
    """One com.microsoft.LinearAttention node: packed (1, T, H * D), K-major state (1, H, K, V)."""
    f = np.float32
    return one_node_model(
        "LinearAttention", [("query", f, [1, "T", H * K]), ("key", f, [1, "T", H * K]), ("value", f, [1, "T", H * V]),
                            ("past_state", f, [1, H, K, V]), ("decay", f, [1, "T", H]), ("beta", f, [1, "T", H])],
        [("output", f, [1, "T", H * V]), ("present_state", f, [1, H, K, V])],
        domain="com.microsoft", opset=21, ir_version=10, update_rule="gated_delta", q_num_heads=H, kv_num_heads=H)


def draw(seed: int, T: int, H: int, K: int, V: int, decay: tuple[float, float]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lo, hi = decay
    return {
        "q": torch.randn(1, T, H, K, generator=gen),
        "k": torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1),
        "v": torch.randn(1, T, H, V, generator=gen),
        "g": torch.rand(1, T, H, generator=gen) * (hi - lo) + lo,
        "beta": torch.sigmoid(torch.randn(1, T, H, generator=gen)),
        "s0_kv": torch.randn(1, H, K, V, generator=gen) * 0.5,
    }


def reference(x: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The float64 expectations through both contracts' argument mappings (they must agree)."""
    _, T, H, K = x["q"].shape
    V = x["v"].shape[-1]
    s0_vk = x["s0_kv"].transpose(-1, -2).contiguous()
    # com.microsoft.GatedDeltaNet: (B, S, H, D), V-major state, every attribute at its default
    _, args, out_shape = ort_contract.gated_delta_net_arguments(
        x["q"], x["k"], x["v"], None, x["g"], x["beta"], s0_vk, None, None,
        update_rule="gated_delta", scale=0.0, gate_activation="none", beta_activation="none", qk_l2_norm=0,
        chunk_size=64, state_update_capacity=0, gate_lower_bound=-5.0)
    args.pop("accept_growth")
    o_gdn, s_vk = check.expected(args)
    # com.microsoft.LinearAttention: packed (B, T, H * D) read back as (B, T, H, D), K-major state,
    # scale 0 -> None (1 / sqrt(K)), as deltarule.contracts.onnx_linear_attention._packed maps it
    packed = {n: x[n].reshape(1, T, -1) for n in ("q", "k", "v")}
    o_la, s_kv = check.expected({
        "q": packed["q"].reshape(1, T, H, K), "k": packed["k"].reshape(1, T, H, K),
        "v": packed["v"].reshape(1, T, H, V), "rule": "gated_delta", "g": x["g"], "beta": x["beta"],
        "scale": None, "initial_state": x["s0_kv"], "chunk_size": 64})
    o_gdn = o_gdn.reshape(out_shape)
    o_la = o_la.reshape(1, T, H, V)
    if not (np.array_equal(o_gdn, o_la) and np.array_equal(s_vk, np.swapaxes(s_kv, -1, -2))):
        raise AssertionError("the GatedDeltaNet and LinearAttention mappings give different references")
    return {"o": o_la, "state_kv": s_kv, "state_vk": s_vk}


def write(folder: str, name: str, x, index: dict) -> None:
    a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    a.astype("<f4").tofile(os.path.join(folder, name + ".f32"))
    index[name] = {"file": f"{os.path.basename(folder)}/{name}.f32", "shape": list(a.shape)}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _run_gdn(session, f: dict, decode: bool) -> tuple[np.ndarray, np.ndarray]:
    """A GatedDeltaNet session over the case: one call, or (decode) T = 1 calls with the state fed back.

    Args:
        session: an onnxruntime InferenceSession of a GatedDeltaNet model.
        f: the case's float32 arrays: q, k [1, T, H, K], v [1, T, H, V], g, beta [1, T, H],
            s0_kv [1, H, K, V] (fed transposed: V-major).
        decode: T calls of one token each instead of one call.
    Returns output [1, T, H, V] and the final V-major state [1, H, V, K].
    """
    state = np.ascontiguousarray(np.swapaxes(f["s0_kv"], -1, -2))
    steps = [slice(t, t + 1) for t in range(f["q"].shape[1])] if decode else [slice(None)]
    outs = []
    for s in steps:
        o, state = session.run(None, {"query": f["q"][:, s], "key": f["k"][:, s], "value": f["v"][:, s],
                                      "decay": f["g"][:, s], "beta": f["beta"][:, s], "initial_state": state})
        outs.append(o)
    return np.concatenate(outs, 1), state


def _run_la(session, f: dict, decode: bool) -> tuple[np.ndarray, np.ndarray]:
    """A LinearAttention session over the case, as `_run_gdn` (inputs packed [1, T, H * D], the
    K-major state s0_kv [1, H, K, V]); returns output [1, T, H, V] and the final [1, H, K, V] state."""
    _, T, H, _ = f["q"].shape
    state = f["s0_kv"]
    steps = [slice(t, t + 1) for t in range(T)] if decode else [slice(None)]
    outs = []
    for s in steps:
        n = f["q"][:, s].shape[1]
        o, state = session.run(None, {"query": f["q"][:, s].reshape(1, n, -1), "key": f["k"][:, s].reshape(1, n, -1),
                                      "value": f["v"][:, s].reshape(1, n, -1), "past_state": state,
                                      "decay": f["g"][:, s], "beta": f["beta"][:, s]})
        outs.append(o.reshape(1, n, H, -1))
    return np.concatenate(outs, 1), state


def check_ort_cpu(out: str, models: list[dict], case: dict, x: dict, ref: dict) -> str:
    """Relative errors of onnxruntime's CPU provider (Python) on every model of `models` against the
    float64 references `ref` of case `case` (a check of the models, not of onnxruntime-web)."""
    import onnxruntime

    f = {n: t.numpy().astype(np.float32) for n, t in x.items()}
    rows = []
    for m in models:
        session = onnxruntime.InferenceSession(os.path.join(out, m["file"]), providers=["CPUExecutionProvider"])
        gdn = m["contract"].endswith("GatedDeltaNet")
        o, s = (_run_gdn if gdn else _run_la)(session, f, case["kind"] == "decode")
        s_ref = ref["state_vk"] if gdn else ref["state_kv"]
        rows.append(f"{m['file']} o {rel(o, ref['o']):.2e} state {rel(s, s_ref):.2e}")
    return "; ".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="web/ort-kernels", help="folder to write (default web/ort-kernels)")
    p.add_argument("--heads", type=int, default=4, help="heads H (query = key = value heads; default 4)")
    p.add_argument("--dk", type=int, default=128, help="key head size K (default 128, Qwen3.5's)")
    p.add_argument("--dv", type=int, default=128, help="value head size V (default 128, Qwen3.5's)")
    p.add_argument("--prefill", type=int, nargs="*", default=[1024, 4096], help="prefill lengths (default 1024 4096)")
    p.add_argument("--decode", type=int, default=64, help="decode steps (default 64; 0: no decode case)")
    p.add_argument("--decay-lo", type=float, default=-0.1, help="log decay drawn from U(lo, hi) (default -0.1)")
    p.add_argument("--decay-hi", type=float, default=-0.005, help="(default -0.005)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gdn-chunk-sizes", type=int, nargs="+", default=[16, 64],
                   help="a GatedDeltaNet model per chunk_size attribute, warmed up in this order (default 16 64)")
    p.add_argument("--check-ort-cpu", action="store_true",
                   help="also run every model in onnxruntime's CPU provider (Python) against the reference")
    a = p.parse_args(argv)
    H, K, V = a.heads, a.dk, a.dv
    if min(H, K, V) < 1 or a.decode < 0 or any(t < 1 for t in a.prefill) or not a.decay_lo <= a.decay_hi <= 0:
        p.error("sizes must be positive and decay_lo <= decay_hi <= 0")
    if any(c < 1 for c in a.gdn_chunk_sizes) or len(set(a.gdn_chunk_sizes)) != len(a.gdn_chunk_sizes):
        p.error("--gdn-chunk-sizes must be distinct positive integers")
    start = time.perf_counter()
    os.makedirs(a.out, exist_ok=True)
    models = ort_models(a.gdn_chunk_sizes, H)
    for m in models:
        gdn = m["contract"] == "com.microsoft.GatedDeltaNet"
        model = gated_delta_net_model(H, K, V, m["attributes"]["chunk_size"]) if gdn else linear_attention_model(H, K, V)
        onnx.save(model, os.path.join(a.out, m["file"]))
    cases = [{"name": f"prefill-T{t}", "kind": "prefill", "tokens": t} for t in a.prefill]
    if a.decode:
        cases.append({"name": f"decode-{a.decode}", "kind": "decode", "tokens": a.decode, "steps": a.decode})
    index = {
        "generator": "benchmarks/ort_web_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "B": 1, "H": H, "K": K, "V": V, "dtype": "float32", "scale": 1 / math.sqrt(K),
        "decay": [a.decay_lo, a.decay_hi], "seed": a.seed,
        "tolerance": TOL["float32"], "error": "||out - ref|| / ||ref|| (float64), deltarule-kernels.js relativeError",
        "ort_models": models,
        "cases": [],
    }
    for i, case in enumerate(cases):
        folder = os.path.join(a.out, case["name"])
        os.makedirs(folder, exist_ok=True)
        x = draw(a.seed * 1000 + i + 1, case["tokens"], H, K, V, (a.decay_lo, a.decay_hi))
        ref = reference(x)
        tensors, expected = {}, {}
        for n in ("q", "k", "v", "g", "beta", "s0_kv"):
            write(folder, n, x[n], tensors)
        write(folder, "s0_vk", x["s0_kv"].transpose(-1, -2), tensors)
        for n in ("o", "state_kv", "state_vk"):
            write(folder, n, ref[n], expected)
        index["cases"].append({**case, "inputs": tensors, "expected": expected})
        note = f" (onnxruntime CPU: {check_ort_cpu(a.out, models, case, x, ref)})" if a.check_ort_cpu else ""
        print(f"{case['name']}: T={case['tokens']} H={H} K={K} V={V}{note}", flush=True)
    with open(os.path.join(a.out, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
    print(f"wrote {a.out}/index.json, {len(models)} models, {len(cases)} cases in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
