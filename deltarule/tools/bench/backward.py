"""`deltarule bench --backward`: forward + backward of the prefill cases.

For each selected prefill case, on the same inputs: deltarule's forward alone
(no autograd), deltarule's forward + backward, and forward + backward by
autograd through the peers' pure-torch functions (transformers' qwen3_next /
kimi_linear chunk functions; fla's naive chunk references for KDA and GDN-2).
The loss is (o * do).sum() + (state * dS).sum() with fixed random do and dS;
every peer's gradients are checked against deltarule's outside the timing.

Memory: "kept" is what the forward keeps for the backward beyond the inputs
(the bytes of the distinct storages autograd saves during the call, the inputs' own left out),
measured with `torch.autograd.graph.saved_tensors_hooks`; "bound" is issue
12's budget for it, twice the forward's outputs plus the chunk-boundary states.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import statistics
import time
from typing import Callable

import torch

from ... import linear_attention
from ...cases import make_inputs
from . import report
from .peers import Skip, TransformersPeer, _available_memory

DIFFERENTIABLE = ("q", "k", "v", "g", "gk", "beta", "erase", "write")
CHECKPOINT = 64       # the chunk of the bound's chunk-boundary states
# What autograd through fla's naive chunk KDA keeps per token and head at K = V = 128
# (measured: 4.6 GB at 32 heads, T = 1024), and the share of available memory it may take.
FLA_NAIVE_BYTES_PER_TOKEN_HEAD = 150e3
FLA_NAIVE_MEMORY_SHARE = 0.6


def run(cases: list[dict], args: argparse.Namespace) -> list[dict]:
    """One result per prefill case: deltarule's times and memory, and each peer's."""
    results = []
    for case in cases:
        if case["kind"] != "prefill":
            continue
        inputs = make_inputs(case, args.dtype)
        leaves = {n: inputs[n] for n in DIFFERENTIABLE if n in inputs}
        gen = torch.Generator().manual_seed(0)
        o, state = linear_attention(**inputs, backend=args.backend)
        do, dS = torch.randn(o.shape, generator=gen), torch.randn(state.shape, generator=gen)
        forward = _median(lambda: _no_grad(lambda: linear_attention(**inputs, backend=args.backend)), args)
        ours = _train_step(lambda: linear_attention(**inputs, backend=args.backend), leaves, do, dS, args)
        entry = {"case": case, "forward_ms": forward * 1e3, **ours.summary(),
                 "bound_bytes": _bound(case, o)}
        entry["peers"] = {name: _peer(make, case, inputs, leaves, do, dS, ours, args) for name, make in PEERS}
        results.append(entry)
    return results


class _Step:
    """A timed forward + backward: seconds, kept bytes, the gradients of the first call."""

    def __init__(self, seconds: float, kept: int, grads: dict):
        self.seconds, self.kept, self.grads = seconds, kept, grads

    def summary(self) -> dict:
        return {"fwd_bwd_ms": self.seconds * 1e3, "kept_bytes": self.kept}


def _train_step(call: Callable, leaves: dict, do, dS, args) -> _Step:
    names = list(leaves)
    inputs = {x.untyped_storage().data_ptr() for x in leaves.values()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    def step(measure_kept: bool = False):
        for x in leaves.values():
            x.requires_grad_(True)
        try:
            if measure_kept:     # only the call's own saves: not the loss's
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    o, state = call()
            else:
                o, state = call()
            loss = (o.float() * do).sum() + (state.float() * dS).sum()
            return dict(zip(names, torch.autograd.grad(loss, [leaves[n] for n in names])))
        finally:
            for x in leaves.values():
                x.requires_grad_(False)

    grads = step(measure_kept=True)
    return _Step(_median(step, args), sum(kept.values()), grads)


def _bound(case: dict, o: torch.Tensor) -> int:
    B, T, Hv, K, V = case["B"], case["T"], case["Hv"], case["K"], case["V"]
    return 2 * o.numel() * o.element_size() + B * Hv * math.ceil(T / CHECKPOINT) * K * V * 4


def _peer(make, case, inputs, leaves, do, dS, ours: _Step, args) -> dict:
    try:
        call = make(case, inputs)
    except Skip as e:
        return {"status": "skipped", "reason": str(e)}
    try:
        step = _train_step(call, leaves, do, dS, args)
    except Exception as e:  # a peer's failure is reported, not fatal
        text = str(e).strip().splitlines()
        return {"status": "error", "reason": f"{type(e).__name__}: {text[0][:120] if text else ''}"}
    errors = [_rel(step.grads[n], ours.grads[n]) for n in step.grads]
    return {"status": "ok", **step.summary(), "ratio": step.seconds / ours.seconds,
            "grad_rel_err": max(errors)}


def _transformers(case: dict, inputs: dict) -> Callable:
    prepared = TransformersPeer().prepare(case, inputs)
    return lambda: prepared.unpack(prepared.run())


def _fla_naive(case: dict, inputs: dict) -> Callable:
    """fla's naive chunk reference for KDA (per-key gk, beta) or GDN-2 (gk, erase, write)."""
    if "gk" not in inputs or "g" in inputs or inputs["q"].shape[2] != inputs["v"].shape[2] \
            or inputs.get("qk_l2norm") or inputs.get("A_log") is not None:
        raise Skip("KDA / GDN-2 with Hq = Hk = Hv and plain gates only")
    B, T, H, K = inputs["k"].shape
    if T % 64:
        raise Skip("T a multiple of 64 only (fla's naive chunk functions assert it)")
    need = FLA_NAIVE_BYTES_PER_TOKEN_HEAD * B * T * H * K * inputs["v"].shape[3] / 128**2
    free = _available_memory()
    if free is not None and need > FLA_NAIVE_MEMORY_SHARE * free:
        raise Skip(f"autograd through fla's naive chunk function would keep ~{need / 2**30:.0f} GiB, "
                   f"{free / 2**30:.0f} GiB available")
    try:
        family = "gdn2" if "erase" in inputs else "kda"
        fn = getattr(importlib.import_module(f"fla.ops.{family}.naive"), f"naive_chunk_{family}")
    except (ImportError, AttributeError) as e:
        raise Skip(f"fla's naive chunk reference is not installed ({e})") from None
    gates = (inputs["erase"], inputs["write"]) if "erase" in inputs else (inputs["beta"],)
    kwargs = {"initial_state": inputs.get("initial_state"), "output_final_state": True}
    if "chunk_size" in inspect.signature(fn).parameters:
        kwargs["chunk_size"] = 64
    return lambda: fn(inputs["q"], inputs["k"], inputs["v"], inputs["gk"], *gates, **kwargs)


PEERS = (("transformers", _transformers), ("fla-naive", _fla_naive))
LEGEND = ("transformers: autograd through qwen3_next torch_chunk_gated_delta_rule (scalar g) / kimi_linear "
          "chunk_kimi_delta_attention (gk); fla-naive: autograd through fla.ops.kda / fla.ops.gdn2 "
          "naive_chunk_* (per-key gk); ratio = peer time / deltarule's forward + backward")


def table(results: list[dict], meta: dict) -> str:
    header = ["case", "BxT", "Hq/Hk/Hv", "fwd ms", "fwd+bwd ms", "x fwd", "kept MB", "bound MB"]
    for name, _ in PEERS:
        header += [f"{name} ms", "ratio", "kept MB", "grad err"]
    rows = []
    for r in results:
        c = r["case"]
        row = [c["name"], f"{c['B']}x{c['T']}", f"{c['Hq']}/{c['Hk']}/{c['Hv']}", f"{r['forward_ms']:.1f}",
               f"{r['fwd_bwd_ms']:.1f}", f"{r['fwd_bwd_ms'] / r['forward_ms']:.2f}",
               f"{r['kept_bytes'] / 2**20:.0f}", f"{r['bound_bytes'] / 2**20:.0f}"]
        for name, _ in PEERS:
            p = r["peers"][name]
            if p["status"] == "ok":
                row += [f"{p['fwd_bwd_ms']:.0f}", f"{p['ratio']:.1f}x", f"{p['kept_bytes'] / 2**20:.0f}",
                        f"{p['grad_rel_err']:.0e}"]
            else:
                row += [p["status"], "-", "-", "-"]
        rows.append(row)
    notes = [f"{r['case']['name']}: {name}: {r['peers'][name]['reason']}" for r in results
             for name, _ in PEERS if r["peers"][name]["status"] != "ok"]
    return "\n".join([
        f"deltarule {meta['deltarule']} bench --backward: torch {meta['torch']}, {meta['threads']} threads, "
        f"dtype {meta['dtype']}, backend {meta['backend']}",
        "times: median of timed forward + backward steps after one untimed step; loss = (o * do).sum() + "
        "(state * dS).sum(); grad err: the peer's largest relative gradient error against deltarule's",
        "kept: bytes the forward saves for the backward beyond the inputs; bound: 2 x outputs + the states "
        f"at every {CHECKPOINT}-token chunk boundary",
        "", *report.align([header, *rows]), "", LEGEND, *notes])


def _median(fn: Callable, args) -> float:
    """Median seconds of up to args.repeat calls within args.budget (one untimed call first)."""
    fn()
    samples, start = [], time.perf_counter()
    while len(samples) < args.repeat:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        if time.perf_counter() - start >= args.budget:
            break
    return statistics.median(samples)


def _no_grad(fn: Callable):
    with torch.no_grad():
        return fn()


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))
