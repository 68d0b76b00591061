"""Chunked (WY / UT) prefill in WGSL: specialize, tabulate and dispatch two passes.

docs/algorithm.md section 3 for the formulas, section 4 for the numerical rules,
docs/wgsl.md for the design. Per chunk of C tokens (C = `chunk_length(p)`):

1. `chunked_intra.wgsl.jinja`, one workgroup per (chunk, state head): the
   cumulative log decay G (float32 pairs: a compensated sum), the normalized
   and decayed copies, A (packed strictly-lower triangle in workgroup memory),
   M, and Ũ = T (w ⊙ v), Y = T (b ⊙ k ⊙ e^G) by forward substitution of
   (I + A) X = RHS, column by column (T is never formed); everything into one
   float32 scratch buffer.
2. `chunked_state.wgsl.jinja`, one workgroup per (value tile, state head,
   sequence): the [K, BV] state tile in workgroup memory across the
   sequence's chunks: U = Ũ - Y S0, O = (Q ⊙ e^G) S0 + M U (scale and the L2
   norm folded into Q), S = diag(e^{G_C}) S0 + K̂ᵀ U; the state is read from and
   written back to the sequence's row in place (the recurrent shader's table,
   owner and clamping conventions).

Long calls run in segments (pass 1 + pass 2 per segment, the state continuing
in place): lavapipe ends a shader after 65535 loop iterations in all (every
loop of the invocation counts), and the scratch buffer is kept under
`SCRATCH_BYTES`.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from ...problem import Problem
from . import _device, recurrent

INTRA = "chunked_intra.wgsl.jinja"
STATE = "chunked_state.wgsl.jinja"
MIN_CHUNK, MAX_CHUNK = 16, 64        # C: a power of two in this range (chunk_length)
INTRA_WORKGROUP = 256
UNROLL = 4                            # K is padded to whole vec4 words
LOOP_BUDGET = 60000                   # loop iterations per invocation (lavapipe stops at 65535)
SCRATCH_BYTES = 64 << 20              # scratch per segment (also capped by the binding limit)
# Sequences at least this long take the chunked path (measured on lavapipe, docs/wgsl.md);
# shorter ones, decode and speculative plans keep the fused recurrence.
MIN_TOKENS = 128


def chunk_length(chunk_size: int, G: int = 1, workgroup_bytes: int = 16384) -> int:
    """C: `chunk_size` rounded up to a power of two, clamped to [16, 64], halved until both
    passes' workgroup memory fits (`fits`)."""
    C = min(MAX_CHUNK, max(MIN_CHUNK, 1 << max(0, math.ceil(math.log2(max(chunk_size, 1))))))
    while C > MIN_CHUNK and not fits(C, G, 4, workgroup_bytes):
        C //= 2
    return C


def fits(C: int, G: int, BV: int, workgroup_bytes: int) -> bool:
    """Pass 1 (A by columns, per-row norms and gates) and pass 2 (U and Q^ S columns of BV
    values) within the adapter's workgroup memory."""
    CQ = C // 4
    intra = (C * C - 8 * CQ * (CQ - 1)) + C * (G + 4)
    return 4 * max(intra, BV * C * (1 + G)) <= workgroup_bytes


def _pad(x: int, m: int) -> int:
    return -(-x // m) * m


def tiling(p: Problem, workgroup_bytes: int) -> dict:
    """C, padded sizes KP / VP and pass 2's value tile BV (one invocation per column, its U and
    Q^ S columns in workgroup memory)."""
    C = chunk_length(p.chunk_size, p.G, workgroup_bytes)
    BV = max(4, min(32, 1 << math.ceil(math.log2(p.V))))
    while BV > 4 and 4 * BV * C * (1 + p.G) > workgroup_bytes:
        BV //= 2
    return dict(C=C, KP=_pad(p.K, UNROLL), VP=_pad(p.V, BV), BV=BV)


def specialization(p: Problem) -> tuple[tuple, tuple]:
    """(pass 1's, pass 2's) template parameters."""
    dt = _device.SHADER_DTYPES
    t = tiling(p, _device.gpu().max_workgroup_bytes)
    b = p.beta if p.beta is not None else p.erase
    raw = "" if p.A_log is None else ("g" if p.g is not None else "gk")
    common = dict(K=p.K, V=p.V, KP=t["KP"], VP=t["VP"], C=t["C"], G=p.G, HV=p.Hv,
                  retrieves=p.retrieves, per_key=p.gk is not None, decays=p.g is not None or p.gk is not None)
    intra = dict(
        common, HQ=p.Hq, HK=p.Hk, WG=INTRA_WORKGROUP, dt_qkv=dt[p.q.dtype],
        has_g=p.g is not None, dt_g=dt[p.g.dtype] if p.g is not None else "",
        has_gk=p.gk is not None, dt_gk=dt[p.gk.dtype] if p.gk is not None else "",
        has_b=b is not None, dt_b=dt[b.dtype] if b is not None else "", b_per_key=p.erase is not None,
        has_w=p.write is not None, dt_w=dt[p.write.dtype] if p.write is not None else "",
        raw_gate=raw, gate_fn="softplus", sigmoid=p.beta_sigmoid, l2norm=p.qk_l2norm,
    )
    state = dict(common, BV=t["BV"], layout=p.state_layout, has_owner=p.plan.overlapping())
    return tuple(sorted(intra.items())), tuple(sorted(state.items()))


def block_floats(C: int, KP: int, VP: int, G: int, per_key: bool) -> int:
    """Scratch floats per (chunk, state head); the templates lay them out in the same order:
    Ũ [C, VP], Y [C, KP], K̂ [C, KP], Q̂ [G, C, KP], M [G, C, C], e^{G_C} [KP], k̂ [C, KP]
    (+ G's two float32 parts [C, KP] each with per-key decay)."""
    return C * VP + 3 * C * KP + G * C * KP + G * C * C + KP + (2 * C * KP if per_key else 0)


def bindings_needed(p: Problem) -> int:
    """Storage buffers of pass 1 (table, scratch, q, k, v + the gates present); pass 2 binds 4."""
    gates = (p.g, p.gk, p.beta if p.beta is not None else p.erase, p.write)
    return 5 + sum(x is not None for x in gates)


def loops_per_chunk(KP: int, C: int) -> int:
    """Loop iterations pass 2 spends per chunk (three row loops and the chunk loop)."""
    return 3 * C + 1


def segment_chunks(p: Problem) -> int:
    """Chunks per sequence per segment (0: the call does not fit the scratch: use the recurrence)."""
    gpu = _device.gpu()
    t = tiling(p, gpu.max_workgroup_bytes)
    per_seq = LOOP_BUDGET // loops_per_chunk(t["KP"], t["C"])
    block = 4 * p.Hv * block_floats(t["C"], t["KP"], t["VP"], p.G, p.gk is not None)
    slots = min(SCRATCH_BYTES, gpu.max_binding_bytes) // block
    slots = min(slots, gpu.max_workgroups)
    live = sum(s.live for s in p.spans)
    return min(per_seq, slots // max(live, 1))


def _table(p: Problem, rows: list[int], skip: int, seg_tokens: int, C: int) -> tuple[np.ndarray, tuple, int]:
    """The uint32 table of one segment (tokens skip .. skip + seg_tokens of every live sequence):
    per live sequence [first chunk slot, chunks, state row, 0]; per chunk slot [first flat token,
    length]; the owners (positions among the live) and A_log / dt_bias bits. Returns the table,
    (chunk, owner, A_log, dt_bias offsets) and the number of chunk slots."""
    live = [n for n, s in enumerate(p.spans) if s.live]
    seqs = np.zeros((len(live), 4), dtype=np.uint32)
    chunks = []
    for i, (n, row) in enumerate(zip(live, rows)):
        s = p.spans[n]
        length = min(max(s.length - skip, 0), seg_tokens)
        first = s.row * p.T + s.start + skip
        count = -(-length // C)
        seqs[i] = (len(chunks), count, row, 0)
        chunks += [(first + c * C, min(C, length - c * C)) for c in range(count)]
    chunk_arr = np.array(chunks, dtype=np.uint32).reshape(-1, 2)
    parts = [seqs.ravel(), chunk_arr.ravel()]
    chunk_offset = seqs.size
    owner_offset = a_log_offset = bias_offset = 0
    if p.plan.overlapping():
        position = np.full(p.N + 1, recurrent.NO_ROW, dtype=np.uint32)
        position[live] = np.arange(len(live), dtype=np.uint32)
        owner_offset = sum(x.size for x in parts)
        parts.append(position[p.plan.owner()])
    if p.A_log is not None:
        a_log_offset = sum(x.size for x in parts)
        parts.append(p.A_log.detach().to("cpu", torch.float32).numpy().view(np.uint32).ravel())
        bias_offset = sum(x.size for x in parts)
        parts.append(p.dt_bias.detach().to("cpu", torch.float32).contiguous().numpy().view(np.uint32).ravel())
    return np.concatenate(parts), (chunk_offset, owner_offset, a_log_offset, bias_offset), len(chunks)


def chunked(p: Problem, state, rows: list[int]) -> torch.Tensor:
    """`recurrent.recurrence`'s contract (no speculative plans) through the chunked form.

    Args:
        p: the validated call (not speculative; `segment_chunks(p) > 0`).
        state: the float32 state buffer in `p.state_layout`; live sequence i reads row
            `rows[i]` and writes its final state there (in place).
        rows: one state row per live sequence, distinct.

    Returns:
        o: [B, T, Ho, V] float32 on the host; tokens no live sequence owns are zero.
    """
    live = sum(s.live for s in p.spans)
    out_bytes = p.B * p.T * p.Ho * p.V * 4
    out = recurrent._output_buffer(out_bytes)
    if live and p.B * p.T:
        intra_spec, state_spec = specialization(p)
        t = dict(state_spec)
        C = t["C"]
        per_seq = segment_chunks(p)
        inputs = {4: _device.upload(p.q), 5: _device.upload(p.k), 6: _device.upload(p.v)}
        b = p.beta if p.beta is not None else p.erase
        for binding, x in ((7, p.g), (8, p.gk), (9, b), (10, p.write)):
            if x is not None:
                inputs[binding] = _device.upload(x)
        block = block_floats(C, t["KP"], t["VP"], p.G, p.gk is not None)
        seg_tokens = per_seq * C
        scratch = None
        for skip in range(0, max(p.max_len, 1), seg_tokens):
            table, offsets, slots = _table(p, rows, skip, seg_tokens, C)
            params = struct.pack("<5I3f", p.B * p.T, *offsets, 1.0, p.scale, p.l2norm_eps)
            uniform, table_buf = _device.uniform(params), _device.upload(table)
            if scratch is None:
                scratch = _device.zeros(4 * block * p.Hv * max(slots, 1))
            if slots:
                _device.dispatch(INTRA, intra_spec, {0: uniform, 1: table_buf, 2: scratch, **inputs},
                                 (slots, p.Hv, 1))
            _device.dispatch(STATE, state_spec, {0: uniform, 1: table_buf, 2: scratch, 3: state, 4: out},
                             (t["VP"] // t["BV"], p.Hv, live))
    if not out_bytes:
        return torch.zeros(p.B, p.T, p.Ho, p.V)
    o = torch.frombuffer(bytearray(_device.download(out, out_bytes)), dtype=torch.float32)
    return o.view(p.B, p.T, p.Ho, p.V)


def wins(p: Problem) -> bool:
    """Whether `p` takes the chunked path: not speculative, a sequence of at least MIN_TOKENS
    tokens, pass 1's bindings and both passes' workgroup memory within the adapter's limits,
    and a segment of at least one chunk per sequence."""
    if p.plan.speculative or p.max_len < MIN_TOKENS or p.B * p.T == 0:
        return False
    gpu = _device.gpu()
    if bindings_needed(p) > gpu.max_storage_buffers:
        return False
    t = tiling(p, gpu.max_workgroup_bytes)
    if not fits(t["C"], p.G, t["BV"], gpu.max_workgroup_bytes):
        return False                  # a very large query group: the recurrence
    return segment_chunks(p) > 0
