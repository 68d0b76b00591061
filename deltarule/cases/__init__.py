"""The contract as data: `manifest.json`, `test.json`, `bench.json`.

A test case is a JSON object (see test.json's "schema" entry); `make_inputs`
turns it into the keyword arguments of `deltarule.linear_attention`,
deterministically from its seed.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@cache
def _load(name: str) -> dict:
    return json.loads(resources.files(__package__).joinpath(name).read_text())


def manifest() -> dict:
    return _load("manifest.json")


def test_cases() -> list[dict]:
    return _load("test.json")["cases"]


def bench_cases() -> list[dict]:
    return _load("bench.json")["cases"]


def case_id(case: dict) -> str:
    return case["name"]


def make_inputs(case: dict, dtype: str = "float32", device: str | torch.device = "cpu") -> dict:
    """Keyword arguments of `linear_attention` for a test or bench case.

    q, k, v and the gates are drawn in float32 from `case["seed"]`, then cast
    to `dtype`; the raw-gate parameters stay float32, the state is float32 or
    the case's `state_dtype`. Keys are L2-normalised unless the case asks for
    `qk_l2norm` (then they are raw).
    """
    gen = torch.Generator().manual_seed(int(case.get("seed", 0)))
    B, T, Hq, Hk, Hv, K, V = (case[x] for x in ("B", "T", "Hq", "Hk", "Hv", "K", "V"))
    rule = case.get("rule", "gated_delta")
    decay = case.get("decay", "g" if rule in ("gated", "gated_delta") else "none")
    update = case.get("update", "beta" if rule in ("delta", "gated_delta") else "none")
    lo, hi = case.get("decay_range", [-1.0, -0.01])
    dt = DTYPES[dtype]

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def uniform(lo_, hi_, *shape):
        return torch.rand(*shape, generator=gen) * (hi_ - lo_) + lo_

    q, k, v = randn(B, T, Hq, K), randn(B, T, Hk, K), randn(B, T, Hv, V)
    qk_l2norm = bool(case.get("qk_l2norm", False))
    if not qk_l2norm:
        k = torch.nn.functional.normalize(k, dim=-1)
    args = {"q": q, "k": k, "v": v, "rule": rule}
    raw_gate = bool(case.get("raw_gate", False))
    if decay in ("g", "g+gk"):
        args["g"] = randn(B, T, Hv) if raw_gate else uniform(lo, hi, B, T, Hv)
    if decay in ("gk", "g+gk"):
        args["gk"] = randn(B, T, Hv, K) if raw_gate else uniform(lo, hi, B, T, Hv, K)
    for t in case.get("decay_resets", []):          # a log decay of -inf: the state restarts at token t
        for name in ("g", "gk"):
            if name in args:
                args[name][:, t] = float("-inf")
    if raw_gate:
        args["A_log"] = uniform(-1.0, 1.0, Hv)
        args["dt_bias"] = uniform(-1.0, 1.0, *((Hv,) if "g" in args else (Hv, K)))
    sigmoid = bool(case.get("beta_sigmoid", False))
    gate = (lambda *s: randn(*s)) if sigmoid else (lambda *s: uniform(0.0, 1.0, *s))
    if update == "beta":
        args["beta"] = gate(B, T, Hv)
    elif update == "erase_write":
        args["erase"], args["write"] = gate(B, T, Hv, K), gate(B, T, Hv, V)
    if sigmoid:
        args["beta_sigmoid"] = True
    for name in ("q", "k", "v", "g", "gk", "beta", "erase", "write"):
        if name in args:
            args[name] = args[name].to(dt)

    layout = case.get("state_layout", "kv")
    N = len(case["cu_seqlens"]) - 1 if case.get("cu_seqlens") is not None else B
    if case.get("initial_state", False):
        rows = case.get("num_slots", N) if case.get("state_indices") is not None else N
        shape = (rows, Hv, K, V) if layout == "kv" else (rows, Hv, V, K)
        args["initial_state"] = (randn(*shape) * 0.5).to(DTYPES[case.get("state_dtype", "float32")])
    args["state_layout"] = layout
    for name in ("cu_seqlens", "seq_lens", "state_indices", "num_accepted_tokens"):
        if case.get(name) is not None:
            args[name] = torch.tensor(case[name], dtype=torch.int32)
    for name in ("scale", "chunk_size", "l2norm_eps"):
        if case.get(name) is not None:
            args[name] = case[name]
    if qk_l2norm:
        args["qk_l2norm"] = True
    if case.get("capture") is not None:             # NaN: an entry a backend should not write stays NaN
        width = (Hv * K if "gk" in args else Hv) + Hk * K + Hv * V
        args["capture"] = torch.full((N, case["capture"] * width), float("nan"))
    device = torch.device(device)
    return {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in args.items()}
