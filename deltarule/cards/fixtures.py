"""`test.json` and `bench.json` of the three kernel cards.

Test cases carry their inputs and expected outputs as tensors
``{"dtype", "shape", "data"}`` (data: base64 of the little-endian bytes;
float16 / bfloat16 as their 16-bit patterns). Expected outputs come from
deltarule's float64 reference (`deltarule.tools.check.expected`), through the same
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

from ..tools import check
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

_RAW = ("qwen", "softplus", "sigmoid", "kda")
# the bind keys of ONNX Runtime's inputs in the operator's order (deltarule.contracts.ort.gated_delta_net's)
GDN_INPUTS = ("queryT", "keyT", "valueT", "cuSeqlensT", "decayT", "betaT", "initialStateT", "aLogT", "dtBiasT",
              "captureCountT", "stateUpdateActiveT")


def _gdn_case(name, *, seed, lead, Hq, Hv, Dk, Dv, dtype="float32", update_rule="gated_delta", cu=None,
              state=False, gate_activation="none", beta_activation="none", qk_l2_norm=0, scale=0.0,
              chunk_size=64, decay_range=(-1.0, -0.01), resets=(), N=None, per_key=False, bias="head",
              gate_lower_bound=-5.0, capacity=0, capture_count=None, active=None, qk_size=1.0):
    """One case; per_key: decay [..., Hv, Dk]; bias: dt_bias "head" [Hv], "key" [Hv, Dk] or "flat"
    [Hv * Dk]; capacity > 0: capture_count (default: C for every request) and, where given,
    state_update_active [active]; qk_size scales the queries and keys (tiny ones make
    qk_l2_norm's epsilon show)."""
    gen = torch.Generator().manual_seed(seed)
    T = torch.float32 if dtype == "float32" else torch.float16
    q = torch.randn(*lead, Hq, Dk, generator=gen) * qk_size
    k = torch.randn(*lead, Hq, Dk, generator=gen) * qk_size
    if not qk_l2_norm:
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(*lead, Hv, Dv, generator=gen)
    q, k, v = q.to(T), k.to(T), v.to(T)
    inputs = {"queryT": q, "keyT": k, "valueT": v}
    if cu is not None:
        inputs["cuSeqlensT"] = torch.tensor(cu, dtype=torch.int32)
    heads = (Hv, Dk) if per_key else (Hv,)
    if update_rule in ("gated", "gated_delta"):
        if gate_activation in _RAW:
            d = torch.randn(*lead, *heads, generator=gen)
        else:
            lo, hi = decay_range
            d = torch.rand(*lead, *heads, generator=gen) * (hi - lo) + lo
            for t in resets:
                d.view(-1, *heads)[t] = float("-inf")
        inputs["decayT"] = d
    if update_rule in ("delta", "gated_delta"):
        b = torch.randn(*lead, Hv, generator=gen)
        inputs["betaT"] = b if beta_activation == "sigmoid" else torch.sigmoid(b)
    if state:
        rows = N if N is not None else (lead[0] if len(lead) == 2 else len(cu) - 1)
        inputs["initialStateT"] = torch.randn(rows, Hv, Dv, Dk, generator=gen) * 0.5
    if gate_activation in _RAW:
        inputs["aLogT"] = torch.rand(Hv, generator=gen) * 2 - 1
        shape = {"head": (Hv,), "key": (Hv, Dk), "flat": (Hv * Dk,)}[bias]
        inputs["dtBiasT"] = torch.rand(*shape, generator=gen) * 2 - 1
    attributes = dict(update_rule=update_rule, gate_activation=gate_activation, beta_activation=beta_activation,
                      qk_l2_norm=qk_l2_norm, scale=scale, chunk_size=chunk_size, state_update_capacity=capacity,
                      gate_lower_bound=gate_lower_bound)
    if capacity:
        requests = len(cu) - 1 if cu is not None else (N if N is not None else lead[0])
        counts = capture_count if capture_count is not None else [capacity] * requests
        inputs["captureCountT"] = torch.tensor(counts, dtype=torch.int32)
        if active is not None:
            inputs["stateUpdateActiveT"] = torch.tensor([active], dtype=torch.int32)
    # ONNX Runtime's contract onto deltarule's call (an active capture adds a zero `capture`)
    _, args, out_shape = ort.gated_delta_net_arguments(*(inputs.get(n) for n in GDN_INPUTS), **attributes)
    args.pop("accept_growth")
    plan = build_plan(args["q"].shape[0], args["q"].shape[1], torch.device("cpu"), cu_seqlens=args["cu_seqlens"],
                      seq_lens=None, state_indices=None, num_accepted_tokens=None, num_slots=None)
    o, s, captured = check.expected_with_capture(args)
    expected = {"outputT": tensor(torch.from_numpy(o).reshape(out_shape), T),
                "finalStateT": tensor(torch.from_numpy(s), torch.float32)}
    tolerance = {"outputT": TOL[dtype], "finalStateT": TOL[dtype]}
    if capacity:
        widths = ((Hv * Dk if per_key else Hv), Hq * Dk, Hv * Dv)       # decay, key, delta per transition
        counts = [min(max(c, 0), capacity, span.length) if active != 0 else 0
                  for c, span in zip(inputs["captureCountT"].tolist(), plan.spans)]
        update = (_state_update(captured, capacity, widths, counts) if captured is not None
                  else np.zeros((plan.N, capacity * sum(widths))))
        expected["stateUpdateT"] = tensor(torch.from_numpy(update))
        tolerance["stateUpdateT"] = TOL["float32"]     # float32 arithmetic on the inputs' values
    return {
        "name": name, "attributes": attributes,
        "inputs": {n: tensor(x) for n, x in inputs.items()},
        "expected": expected, "tolerance": tolerance,
        "poison": plan.covered(),
    }


def _state_update(captured: np.ndarray, C: int, widths: tuple, counts: list[int]) -> np.ndarray:
    """ONNX Runtime's `state_update` [N, C * sum(widths)] from the reference's capture buffer
    (deltarule's `capture`: the same layout, each sequence's first min(C, length) transitions):
    request n's first counts[n] transitions of each part (decay, key, delta), zero elsewhere (the
    card leaves the rest zero; ONNX Runtime leaves it unspecified)."""
    out = np.zeros_like(captured)
    base = 0
    for w in widths:
        for n, c in enumerate(counts):
            out[n, base: base + c * w] = captured[n, base: base + c * w]
        base += C * w
    return out


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
    return cases + _per_key_cases() + _capture_cases()


def _per_key_cases() -> list[dict]:
    """ONNX Runtime 1.32's per-key-dimension decay and bounded sigmoid ("kda") gate; S >= 128 takes
    the chunked form under "auto"."""
    return [
        _gdn_case("perkey-T12-cu-empty", seed=20, lead=(12,), Hq=1, Hv=2, Dk=12, Dv=9, cu=[0, 5, 5, 12], state=True,
                  per_key=True),
        _gdn_case("perkey-kda-T12-cu-empty-bias-key", seed=21, lead=(12,), Hq=1, Hv=2, Dk=12, Dv=9,
                  cu=[0, 5, 5, 12], state=True, per_key=True, gate_activation="kda", bias="key"),
        _gdn_case("perkey-softplus-B2-S9-Hq2-Hv4-K100-bias-head-l2norm", seed=22, lead=(2, 9), Hq=2, Hv=4, Dk=100,
                  Dv=20, state=True, per_key=True, gate_activation="softplus", qk_l2_norm=1,
                  beta_activation="sigmoid"),
        _gdn_case("perkey-sigmoid-B2-S9-bias-flat-bound-2-f16", seed=23, lead=(2, 9), Hq=2, Hv=2, Dk=16, Dv=16,
                  dtype="float16", per_key=True, gate_activation="sigmoid", bias="flat", gate_lower_bound=-2.0),
        _gdn_case("perkey-gated-B1-S140-chunked", seed=24, lead=(1, 140), Hq=1, Hv=2, Dk=32, Dv=32, state=True,
                  update_rule="gated", per_key=True, decay_range=(-0.3, -0.01)),
        _gdn_case("perkey-kda-B1-S140-Hq1-Hv2-chunked", seed=25, lead=(1, 140), Hq=1, Hv=2, Dk=32, Dv=32,
                  per_key=True, gate_activation="kda", bias="key", qk_l2_norm=1),
        # |q|^2, |k|^2 ~ 1e-5: the kda gate's epsilon 1e-6 (1e-12 with the others): the other one moves o by ~9 %
        _gdn_case("kda-l2norm-eps-tiny-qk-B1-S6", seed=27, lead=(1, 6), Hq=1, Hv=2, Dk=16, Dv=16, state=True,
                  gate_activation="kda", qk_l2_norm=1, qk_size=1e-3, capacity=2),
        _gdn_case("softplus-l2norm-eps-tiny-qk-B1-S6", seed=27, lead=(1, 6), Hq=1, Hv=2, Dk=16, Dv=16, state=True,
                  gate_activation="softplus", qk_l2_norm=1, qk_size=1e-3, capacity=2),
        _gdn_case("kda-scalar-B1-S140-chunked", seed=26, lead=(1, 140), Hq=2, Hv=2, Dk=32, Dv=32, state=True,
                  gate_activation="kda", beta_activation="sigmoid"),
    ]


def _capture_cases() -> list[dict]:
    """Compact transition capture (state_update_capacity, capture_count, state_update_active):
    counts clamped to [0, min(C, length)], requests below and above C, empty requests, per-key
    decay, GVA, K = 100, the rules without decay or retrieval, an inactive capture, and a long
    request the capture keeps on the recurrence."""
    return [
        _gdn_case("capture-C3-T16-cu-empty-counts-clamped", seed=30, lead=(16,), Hq=1, Hv=2, Dk=12, Dv=9,
                  cu=[0, 5, 5, 12, 14, 16], state=True, capacity=3, capture_count=[2, 3, 9, 9, -1]),
        _gdn_case("capture-C3-T16-cu-empty-counts-clamped-f16", seed=30, lead=(16,), Hq=1, Hv=2, Dk=12, Dv=9,
                  dtype="float16", cu=[0, 5, 5, 12, 14, 16], state=True, capacity=3, capture_count=[2, 3, 9, 9, -1]),
        _gdn_case("capture-perkey-kda-C8-B2-S3-Hq2-Hv4-K100-l2norm", seed=31, lead=(2, 3), Hq=2, Hv=4, Dk=100,
                  Dv=36, state=True, per_key=True, gate_activation="kda", bias="key", qk_l2_norm=1,
                  beta_activation="sigmoid", capacity=8, capture_count=[8, 1]),
        _gdn_case("capture-qwen-C4-B3-S4-uniform-packing", seed=32, lead=(12,), Hq=2, Hv=2, Dk=16, Dv=24,
                  state=True, N=3, gate_activation="qwen", capacity=4),
        _gdn_case("capture-linear-C2-B2-S5", seed=33, lead=(2, 5), Hq=1, Hv=2, Dk=16, Dv=16,
                  update_rule="linear", capacity=2),
        _gdn_case("capture-delta-C5-B2-S4", seed=34, lead=(2, 4), Hq=2, Hv=2, Dk=16, Dv=16,
                  update_rule="delta", state=True, capacity=5, capture_count=[5, 2]),
        _gdn_case("capture-gated-perkey-C2-B1-S6-resets", seed=35, lead=(1, 6), Hq=1, Hv=1, Dk=16, Dv=16,
                  update_rule="gated", per_key=True, decay_range=(-6.0, -2.0), resets=(1,), capacity=2),
        _gdn_case("capture-inactive-C4-B2-S5", seed=36, lead=(2, 5), Hq=1, Hv=2, Dk=16, Dv=16, state=True,
                  capacity=4, active=0),
        _gdn_case("capture-active-C4-B2-S5", seed=36, lead=(2, 5), Hq=1, Hv=2, Dk=16, Dv=16, state=True,
                  capacity=4, active=1),
        _gdn_case("capture-C6-B1-S140-recurrent", seed=37, lead=(1, 140), Hq=1, Hv=2, Dk=32, Dv=32, state=True,
                  capacity=6),
    ]


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
    """A case the card runs: float32 states, no compact capture (this card has none: a capture
    with a slab is a verify call, which stores nothing), within the size caps."""
    B, T, Hq, Hk, Hv, K, V = (case[x] for x in ("B", "T", "Hq", "Hk", "Hv", "K", "V"))
    return (case.get("state_dtype", "float32") == "float32" and case.get("capture") is None
            and B * T * (Hq * K + Hk * K + Hv * V + Hv * K)
            <= (MAX_STRONG if case["name"].startswith("strong-") else MAX_ELEMENTS))


def linear_attention_tests() -> list[dict]:
    """deltarule's own test.json cases (float32 states, no capture, size-capped), every dtype each lists."""
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
