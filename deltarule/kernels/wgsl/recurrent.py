"""Specialize, bind and dispatch `recurrent.wgsl.jinja` for a validated `Problem`.

Inputs go to the device in their own layout and dtype (token-major
[B, T, H, D], 16-bit types packed): the shader applies the raw-gate arm,
beta_sigmoid and the L2 norm itself. The state is one float32 buffer in the
caller's layout ("kv" [S, Hv, K, V] or "vk" [S, Hv, V, K]) updated in place
on the rows the caller names, so a device-resident slab never leaves the GPU.
With a speculative plan each sequence reads one row and stores the state
after each of its tokens into that token's row (no final store). With a
capture (`Problem.capture`) the shader also writes each sequence's first
transitions (decay factors, key, delta u) into a float32 buffer in ONNX
Runtime's `state_update` layout (`deltarule.linear_attention`'s `capture`).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from ...problem import Problem
from . import _device

TEMPLATE = "recurrent.wgsl.jinja"
MAX_WORKGROUP = 256                  # WebGPU's default limit on invocations per workgroup
KEYS_PER_INVOCATION = 16             # state registers per invocation the split aims for
# Tokens of each sequence per dispatch: lavapipe ends any shader loop after 65535
# iterations, so longer sequences run as several dispatches.
SEGMENT = 32768


def tiling(K: int, V: int, G: int, retrieves: bool, l2norm: bool, workgroup_bytes: int) -> tuple[int, int]:
    """(KS, BV): key slices per value column and value columns per workgroup.

    About 16 keys per invocation (at most 8 slices), up to 32 value columns,
    narrowed until the double-buffered partial sums fit in workgroup memory.
    """
    KS = min(8, 1 << max(0, math.ceil(math.log2(math.ceil(K / KEYS_PER_INVOCATION)))))
    BV = min(32, 1 << math.ceil(math.log2(V)), MAX_WORKGROUP // KS)
    NR, NS = _sums(G, retrieves, l2norm)
    while BV > 1 and 4 * 2 * (NR * KS * BV + NS * KS) > workgroup_bytes:
        BV //= 2
    return KS, BV


def _sums(G: int, retrieves: bool, l2norm: bool) -> tuple[int, int]:
    """(column sums, scalar sums) per token: p per query (+ r); k.q per query (+ |k|^2, |q|^2)."""
    return G + int(retrieves), G + (1 + G if l2norm else 0)


def specialization(p: Problem) -> tuple:
    """The template's parameters for `p`: head sizes, head grouping, layout, dtypes, flags."""
    dt = _device.SHADER_DTYPES
    KS, BV = tiling(p.K, p.V, p.G, p.retrieves, p.qk_l2norm, _device.gpu().max_workgroup_bytes)
    NR, NS = _sums(p.G, p.retrieves, p.qk_l2norm)
    b = p.beta if p.beta is not None else p.erase
    raw = "" if p.A_log is None else ("g" if p.g is not None else "gk")
    spec = dict(
        K=p.K, V=p.V, KS=KS, KC=math.ceil(p.K / KS), BV=BV, G=p.G, HQ=p.Hq, HK=p.Hk, HV=p.Hv,
        NR=NR, NS=NS, layout=p.state_layout, dt_qkv=dt[p.q.dtype],
        has_g=p.g is not None, dt_g=dt[p.g.dtype] if p.g is not None else "",
        has_gk=p.gk is not None, dt_gk=dt[p.gk.dtype] if p.gk is not None else "",
        has_b=b is not None, dt_b=dt[b.dtype] if b is not None else "", b_per_key=p.erase is not None,
        has_w=p.write is not None, dt_w=dt[p.write.dtype] if p.write is not None else "",
        w_per_value=p.write is not None,
        raw_gate=raw, gate_fn="softplus", sigmoid=p.beta_sigmoid, l2norm=p.qk_l2norm,
        has_owner=p.plan.overlapping(), speculative=p.plan.speculative, state_in=False, capture=p.capacity,
        capture_in_out=False,
    )
    return tuple(sorted(spec.items()))


def bindings_needed(p: Problem) -> int:
    """Storage buffers the specialization binds (table, state, out, q, k, v + the gates present
    + the capture)."""
    gates = (p.g, p.gk, p.beta if p.beta is not None else p.erase, p.write, p.capture)
    return 6 + sum(x is not None for x in gates)


NO_ROW = 0xFFFFFFFF                  # a row the shader never reads or writes (past every buffer)


def _table(p: Problem, rows: list[int], token_rows: np.ndarray | None, skip: int,
           captures: np.ndarray | None = None) -> tuple[np.ndarray, int, int, int, int]:
    """The shader's table (uint32) for tokens skip .. skip + SEGMENT of every live
    sequence, and the offsets of owners, A_log, dt_bias and the capture entries in it. Per
    sequence: first token, length, state row, and (speculative) the offset of its per-token
    rows; per capturing sequence (`captures` [live, 2]: capture row, transitions): the row, the
    transitions that fall in this segment and the index of the first."""
    live = [n for n, s in enumerate(p.spans) if s.live]
    seqs = np.zeros((len(live), 4), dtype=np.uint32)
    for i, (n, row) in enumerate(zip(live, rows)):
        s = p.spans[n]
        seqs[i, :3] = (s.row * p.T + s.start + skip, min(max(s.length - skip, 0), SEGMENT), row)
    parts = [seqs.ravel()]
    owner_offset = a_log_offset = bias_offset = 0
    if token_rows is not None:
        seqs[:, 3] = seqs.size + np.arange(len(live), dtype=np.uint32) * token_rows.shape[1]
        parts.append(token_rows.astype(np.uint32).ravel())
    if p.plan.overlapping():
        position = np.full(p.N + 1, NO_ROW, dtype=np.uint32)    # owners as positions among the live
        position[live] = np.arange(len(live), dtype=np.uint32)
        owner_offset = sum(x.size for x in parts)
        parts.append(position[p.plan.owner()])                  # -1 (no owner) reads position[N]
    if p.A_log is not None:
        a_log_offset = sum(x.size for x in parts)
        parts.append(p.A_log.detach().to("cpu", torch.float32).numpy().view(np.uint32).ravel())
        bias_offset = sum(x.size for x in parts)
        parts.append(p.dt_bias.detach().to("cpu", torch.float32).contiguous().numpy().view(np.uint32).ravel())
    capture_offset = 0
    if captures is not None:
        capture_offset = sum(x.size for x in parts)
        parts.append(capture_entries(captures, skip).ravel())
    return np.concatenate(parts), owner_offset, a_log_offset, bias_offset, capture_offset


def capture_entries(captures: np.ndarray, skip: int) -> np.ndarray:
    """The table's capture entries of one segment: per live sequence (capture row, transitions
    of the segment: those past `skip` of its count, index of the first = skip, 0)."""
    entries = np.zeros((captures.shape[0], 4), dtype=np.uint32)
    entries[:, 0] = captures[:, 0]
    entries[:, 1] = np.clip(captures[:, 1].astype(np.int64) - skip, 0, SEGMENT)
    entries[:, 2] = skip
    return entries


def _output_buffer(nbytes: int):
    """Zero-filled: tokens no live sequence owns read as zero (tests swap in a NaN fill)."""
    return _device.zeros(nbytes)


def recurrence(p: Problem, state, rows: list[int], token_rows: np.ndarray | None = None,
               capture=None) -> torch.Tensor:
    """Run every live sequence of `p` (in sequence order) on the device.

    Args:
        p: the validated call.
        state: a wgpu storage buffer, float32 [S, Hv, K, V] ("kv") or
            [S, Hv, V, K] ("vk"), in `p.state_layout`; live sequence i reads its
            initial state from row `rows[i]` and writes its final state there
            (IN PLACE; rows outside the buffer are neither read nor written).
        rows: one state row per live sequence, distinct.
        token_rows: with a speculative plan, [live, L] buffer rows (NO_ROW: none)
            that receive the state after each token, instead of the final store.
        capture: with `p.capture`, a wgpu storage buffer float32 [N, W] (`p.capture`'s
            layout): live sequence n writes its first min(C, length) transitions into
            row n (IN PLACE; every other element is left as it was).

    Returns:
        o: [B, T, Ho, V] float32 on the host; tokens no live sequence owns are zero.
    """
    live = sum(s.live for s in p.spans)
    out_bytes = p.B * p.T * p.Ho * p.V * 4
    out = _output_buffer(out_bytes)
    if live and p.B * p.T:
        buffers = {2: state, 3: out, 4: _device.upload(p.q), 5: _device.upload(p.k), 6: _device.upload(p.v)}
        b = p.beta if p.beta is not None else p.erase
        for binding, x in ((7, p.g), (8, p.gk), (9, b), (10, p.write)):
            if x is not None:
                buffers[binding] = _device.upload(x)
        captures = None
        if p.capture is not None:
            buffers[12] = capture
            captures = np.array([(n, min(p.capacity, s.length)) for n, s in enumerate(p.spans) if s.live],
                                dtype=np.int64).reshape(-1, 2)
        spec = specialization(p)
        grid = (math.ceil(p.V / dict(spec)["BV"]), p.Hv, live)
        # the state stays in place between segments, so a split sequence continues exactly
        for skip in range(0, max(p.max_len, 1), SEGMENT):
            table, owner_offset, a_log_offset, bias_offset, capture_offset = _table(p, rows, token_rows, skip,
                                                                                    captures)
            params = struct.pack("<4I2f2I", p.B * p.T, owner_offset, a_log_offset, bias_offset,
                                 p.scale, p.l2norm_eps, capture_offset, 0)
            buffers.update({0: _device.uniform(params), 1: _device.upload(table)})
            _device.dispatch(TEMPLATE, spec, buffers, grid)
    if not out_bytes:
        return torch.zeros(p.B, p.T, p.Ho, p.V)
    o = torch.frombuffer(bytearray(_device.download(out, out_bytes)), dtype=torch.float32)
    return o.view(p.B, p.T, p.Ho, p.V)
