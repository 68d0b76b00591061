"""`test.json` and `bench.json` of the three kernel cards.

Test cases carry their inputs and expected outputs as tensors
``{"dtype", "shape", "data"}`` (data: base64 of the little-endian bytes;
float16 / bfloat16 as their 16-bit patterns). Expected outputs come from
deltarule's float64 reference (`deltarule.check.expected`), through the same
argument mapping the Python adapters use, rounded to the output's dtype only
when written. A case passes when every output's relative error
``||out - expected|| / ||expected||`` (float64, NaN fails) is within its
tolerance. ``"poison": true`` marks cases where the kernel writes every output
element, so a runner may fill the outputs with NaN first to catch unwritten ones.
"""

from __future__ import annotations

import base64

import numpy as np
import torch

from .. import check
from ..batch import build as build_plan
from ..cases import make_inputs, test_cases
from ..contracts import ort

JSON_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.int32: "int32", torch.float64: "float32"}
# tolerances of the ORT cards per logical dtype of T (float16 outputs are rounded on store)
TOL = {"float32": 5e-5, "float16": 5e-3}
# deltarule's test.json cases above this many input elements stay out of the card (JSON size),
# but for the strong-decay ones over long sequences, kept up to MAX_STRONG
MAX_ELEMENTS = 150_000
MAX_STRONG = 600_000


def tensor(x, dtype: torch.dtype | None = None) -> dict:
    """A tensor as JSON: values rounded to `dtype` (default: x's), 16-bit types as raw bits."""
    t = torch.as_tensor(x).detach().cpu()
    dtype = dtype or t.dtype
    if dtype == torch.float64:
        dtype = torch.float32
    t = t.to(dtype).contiguous()
    raw = t.view(torch.int16) if dtype in (torch.float16, torch.bfloat16) else t
    return {"dtype": JSON_DTYPES[dtype], "shape": list(t.shape),
            "data": base64.b64encode(raw.numpy().tobytes()).decode("ascii")}


# --- com.microsoft.GatedDeltaNet ------------------------------------------------------------

def _gdn_case(name, *, seed, lead, Hq, Hv, Dk, Dv, dtype="float32", update_rule="gated_delta", cu=None,
              state=False, gate_activation="none", beta_activation="none", qk_l2_norm=0, scale=0.0,
              chunk_size=64, decay_range=(-1.0, -0.01), resets=(), N=None):
    gen = torch.Generator().manual_seed(seed)
    T = torch.float32 if dtype == "float32" else torch.float16
    q = torch.randn(*lead, Hq, Dk, generator=gen)
    k = torch.randn(*lead, Hq, Dk, generator=gen)
    if not qk_l2_norm:
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(*lead, Hv, Dv, generator=gen)
    q, k, v = q.to(T), k.to(T), v.to(T)
    inputs = {"queryT": q, "keyT": k, "valueT": v}
    if cu is not None:
        inputs["cuSeqlensT"] = torch.tensor(cu, dtype=torch.int32)
    if update_rule in ("gated", "gated_delta"):
        if gate_activation == "qwen":
            d = torch.randn(*lead, Hv, generator=gen)
        else:
            lo, hi = decay_range
            d = torch.rand(*lead, Hv, generator=gen) * (hi - lo) + lo
            for t in resets:
                d.view(-1, Hv)[t] = float("-inf")
        inputs["decayT"] = d
    if update_rule in ("delta", "gated_delta"):
        b = torch.randn(*lead, Hv, generator=gen)
        inputs["betaT"] = b if beta_activation == "sigmoid" else torch.sigmoid(b)
    if state:
        rows = N if N is not None else (lead[0] if len(lead) == 2 else len(cu) - 1)
        inputs["initialStateT"] = torch.randn(rows, Hv, Dv, Dk, generator=gen) * 0.5
    if gate_activation == "qwen":
        inputs["aLogT"] = torch.rand(Hv, generator=gen) * 2 - 1
        inputs["dtBiasT"] = torch.rand(Hv, generator=gen) * 2 - 1
    attributes = dict(update_rule=update_rule, gate_activation=gate_activation, beta_activation=beta_activation,
                      qk_l2_norm=qk_l2_norm, scale=scale, chunk_size=chunk_size, state_update_capacity=0)
    names = ("queryT", "keyT", "valueT", "cuSeqlensT", "decayT", "betaT", "initialStateT", "aLogT", "dtBiasT")
    _, args, out_shape = ort.gated_delta_net_arguments(*(inputs.get(n) for n in names), **attributes,
                                                       gate_lower_bound=-5.0)
    args.pop("accept_growth")
    o, s = check.expected(args)
    plan = build_plan(args["q"].shape[0], args["q"].shape[1], torch.device("cpu"), cu_seqlens=args["cu_seqlens"],
                      seq_lens=None, state_indices=None, num_accepted_tokens=None, num_slots=None)
    return {
        "name": name, "attributes": attributes,
        "inputs": {n: tensor(x) for n, x in inputs.items()},
        "expected": {"outputT": tensor(torch.from_numpy(o).reshape(out_shape), T),
                     "finalStateT": tensor(torch.from_numpy(s), torch.float32)},
        "tolerance": {"outputT": TOL[dtype], "finalStateT": TOL[dtype]},
        "poison": plan.covered(),
    }


def gated_delta_net_tests() -> list[dict]:
    cases = []
    for dtype in ("float32", "float16"):
        f = "" if dtype == "float32" else "-f16"
        cases += [
            _gdn_case(f"card-example-T12-cu-empty{f}", seed=1, lead=(12,), Hq=1, Hv=2, Dk=12, Dv=9, dtype=dtype,
                      cu=[0, 5, 5, 12], state=True),
            _gdn_case(f"qwen-B1-S130-Hq2-Hv4-l2norm-sigmoid{f}", seed=2, lead=(1, 130), Hq=2, Hv=4, Dk=32, Dv=32,
                      dtype=dtype, state=True, gate_activation="qwen", beta_activation="sigmoid", qk_l2_norm=1),
            _gdn_case(f"gated_delta-B2-S65-K100-V60{f}", seed=3, lead=(2, 65), Hq=2, Hv=2, Dk=100, Dv=60,
                      dtype=dtype),
        ]
    cases += [
        _gdn_case("linear-B2-S65-Hq2-Hv4", seed=4, lead=(2, 65), Hq=2, Hv=4, Dk=32, Dv=32, update_rule="linear"),
        _gdn_case("gated-B2-S65", seed=5, lead=(2, 65), Hq=2, Hv=2, Dk=32, Dv=32, update_rule="gated", state=True),
        _gdn_case("delta-B2-S63-sigmoid", seed=6, lead=(2, 63), Hq=2, Hv=2, Dk=32, Dv=32, update_rule="delta",
                  beta_activation="sigmoid"),
        _gdn_case("T1-decode-B3-state", seed=7, lead=(3, 1), Hq=2, Hv=4, Dk=64, Dv=64, state=True),
        _gdn_case("cu-clamped-decreasing-overlap-T30", seed=8, lead=(30,), Hq=1, Hv=2, Dk=16, Dv=16,
                  cu=[0, 20, 10, 40, 99], state=True),
        _gdn_case("cu-uncovered-tokens-T40", seed=9, lead=(40,), Hq=1, Hv=1, Dk=16, Dv=16, cu=[5, 12, 30]),
        _gdn_case("uniform-packing-T20-N2", seed=10, lead=(20,), Hq=1, Hv=2, Dk=16, Dv=24, state=True, N=2),
        _gdn_case("scale-chunk16-B1-S70", seed=11, lead=(1, 70), Hq=1, Hv=1, Dk=32, Dv=32, scale=0.3,
                  chunk_size=16),
        _gdn_case("strong-decay-resets-B1-S2048", seed=12, lead=(1, 2048), Hq=1, Hv=2, Dk=32, Dv=32,
                  decay_range=(-8.0, -2.0), resets=(100, 1500)),
        _gdn_case("long-B1-S1100-Hv4", seed=13, lead=(1, 1100), Hq=2, Hv=4, Dk=64, Dv=64, state=True),
    ]
    return cases


# --- com.microsoft.LinearAttentionGate ------------------------------------------------------

def _gate_case(name, *, seed, shape, dtype="float32", with_b=True, outputs=None, spread=3.0):
    gen = torch.Generator().manual_seed(seed)
    T = torch.float32 if dtype == "float32" else torch.float16
    H = shape[-1]
    a = (torch.randn(*shape, generator=gen) * spread).to(T)
    dt_bias, scale = torch.randn(H, generator=gen), -torch.exp(torch.randn(H, generator=gen))
    inputs = {"aT": a, "dtBiasT": dt_bias, "decayScaleT": scale}
    wanted = outputs or (["decayT", "betaT"] if with_b else ["decayT"])
    expected = {"decayT": tensor(scale.double() * torch.nn.functional.softplus(a.double() + dt_bias.double()), T)}
    if with_b:
        b = (torch.randn(*shape, generator=gen) * spread).to(T)
        inputs["bT"] = b
        if "betaT" in wanted:
            expected["betaT"] = tensor(torch.sigmoid(b.double()), T)
    case = {"name": name, "attributes": {}, "inputs": {n: tensor(x) for n, x in inputs.items()},
            "expected": expected, "tolerance": {n: TOL[dtype] for n in expected}, "poison": True}
    if outputs:
        case["outputs"] = outputs
    return case


def linear_attention_gate_tests() -> list[dict]:
    return [
        _gate_case("card-example-H5", seed=1, shape=(5,), with_b=False),
        _gate_case("B2-T3-H4-beta", seed=2, shape=(2, 3, 4)),
        _gate_case("B2-T3-H4-beta-f16", seed=3, shape=(2, 3, 4), dtype="float16"),
        _gate_case("unconsumed-b", seed=4, shape=(7, 3), outputs=["decayT"]),
        _gate_case("tails-T4099-H16", seed=5, shape=(4099, 16), spread=30.0),
        _gate_case("tails-T1000-H6-f16", seed=6, shape=(1000, 6), dtype="float16", spread=12.0),
    ]


# --- deltarule.LinearAttention --------------------------------------------------------------

_CARD_INPUTS = {"q": "qT", "k": "kT", "v": "vT", "g": "gT", "gk": "gkT", "beta": "betaT", "erase": "eraseT",
                "write": "writeT", "initial_state": "initialStateT", "cu_seqlens": "cuSeqlensT",
                "seq_lens": "seqLensT", "state_indices": "stateIndicesT",
                "num_accepted_tokens": "numAcceptedTokensT", "A_log": "aLogT", "dt_bias": "dtBiasT"}
_CARD_ATTRIBUTES = ("rule", "state_layout", "l2norm_eps", "chunk_size")


def _fits(case: dict) -> bool:
    B, T, Hq, Hk, Hv, K, V = (case[x] for x in ("B", "T", "Hq", "Hk", "Hv", "K", "V"))
    return (case.get("state_dtype", "float32") == "float32"
            and B * T * (Hq * K + Hk * K + Hv * V + Hv * K)
            <= (MAX_STRONG if case["name"].startswith("strong-") else MAX_ELEMENTS))


def linear_attention_tests() -> list[dict]:
    """deltarule's own test.json cases (float32 states, size-capped), every dtype each lists."""
    cases = []
    for case in test_cases():
        if not _fits(case):
            continue
        for dtype in case["dtypes"]:
            args = make_inputs(case, dtype)
            o, s = check.expected(args)
            inputs = {_CARD_INPUTS[n]: tensor(x) for n, x in args.items()
                      if n in _CARD_INPUTS and x is not None}
            for n in ("cuSeqlensT", "seqLensT", "stateIndicesT", "numAcceptedTokensT"):
                if n in inputs:
                    inputs[n] = tensor(args[_key(n)].to(torch.int32))
            attributes = {n: args[n] for n in _CARD_ATTRIBUTES if n in args}
            attributes.update(scale=float(args.get("scale") or 0.0), qk_l2norm=int(bool(args.get("qk_l2norm"))),
                              beta_sigmoid=int(bool(args.get("beta_sigmoid"))))
            v = args["v"]
            plan = build_plan(v.shape[0], v.shape[1], torch.device("cpu"), cu_seqlens=args.get("cu_seqlens"),
                              seq_lens=args.get("seq_lens"), state_indices=args.get("state_indices"),
                              num_accepted_tokens=args.get("num_accepted_tokens"),
                              num_slots=args["initial_state"].shape[0] if args.get("state_indices") is not None
                              else None)
            tol = float(case["tol"][dtype])
            cases.append({
                "name": case["name"] + ("" if dtype == "float32" else f"-{dtype}"),
                "attributes": attributes, "inputs": inputs,
                "expected": {"oT": tensor(torch.from_numpy(o), v.dtype), "stateT": tensor(torch.from_numpy(s))},
                "tolerance": {"oT": tol, "stateT": tol},
                "poison": plan.covered(),
            })
    return cases


def _key(bind: str) -> str:
    return next(n for n, b in _CARD_INPUTS.items() if b == bind)


# --- bench.json -----------------------------------------------------------------------------

def bench_cases(op: str) -> list[dict]:
    """Shapes and attributes (the runner draws the inputs): prefill at 1k and 4k tokens, decode."""
    if op == "com.microsoft.LinearAttentionGate":
        return [{"name": f"gate-T{t}-H32", "shapes": {"aT": [t, 32], "dtBiasT": [32], "decayScaleT": [32],
                                                      "bT": [t, 32]}, "dtype": "float32"} for t in (1024, 16384)]
    H, D = 4, 64
    if op == "com.microsoft.GatedDeltaNet":
        def shapes(T):
            return {"queryT": [1, T, H, D], "keyT": [1, T, H, D], "valueT": [1, T, H, D], "decayT": [1, T, H],
                    "betaT": [1, T, H], "initialStateT": [1, H, D, D]}
    else:
        def shapes(T):
            return {"qT": [1, T, H, D], "kT": [1, T, H, D], "vT": [1, T, H, D], "gT": [1, T, H],
                    "betaT": [1, T, H], "initialStateT": [1, H, D, D]}
    cases = [{"name": f"prefill-T{T}-H{H}-D{D}", "kind": "prefill", "shapes": shapes(T), "dtype": "float32"}
             for T in (1024, 4096)]
    cases.append({"name": f"decode-B1-H{H}-D{D}", "kind": "decode", "shapes": shapes(1), "dtype": "float32",
                  "steps": 64})
    return cases


def decode(t: dict) -> np.ndarray:
    """A JSON tensor back to NumPy (16-bit types as their raw uint16 bits)."""
    raw = base64.b64decode(t["data"])
    dt = {"float32": np.float32, "int32": np.int32, "float16": np.float16, "bfloat16": np.uint16}[t["dtype"]]
    return np.frombuffer(raw, dtype=dt).reshape(t["shape"])
