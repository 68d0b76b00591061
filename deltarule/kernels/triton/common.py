"""Pieces the Triton kernels share: the input preprocessing they fuse, and the state's addressing.

Preprocessing, applied as the operands are loaded (no extra pass over memory,
no extra launch; docs/design.md section 1):

- `l2norm_rows`: `qk_l2norm`, x * rsqrt(sum(x^2) + eps) per row of a loaded
  [R, BK] q or k block (masked columns are zero, so the sum is the row's);
- `raw_log_decay`: the raw-gate arm, -exp(A_log) * softplus(x + dt_bias);
- `update_gate`: `beta_sigmoid`, the sigmoid of beta / erase / write.

All in float32. Under `TRITON_INTERPRET=1` (set before this module is
imported) they run on CPU tensors like the kernels that call them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def softplus(x):
    """log(1 + exp(x)) without overflow, accurate where exp(x) is tiny (log1p through
    log(u) * e / (u - 1), u = 1 + e, which is exact to rounding); x above 20 returns x,
    as torch's softplus does, and so does NaN (tl.minimum drops a NaN operand: the test is
    written so that NaN takes the x branch)."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x <= 20.0, log1p, x)


@triton.jit
def raw_log_decay(b_x, b_a, b_dtb):
    """The raw-gate arm: log decay -exp(A_log) * softplus(x + dt_bias), float32."""
    return -tl.exp(b_a) * softplus(b_x + b_dtb)


@triton.jit
def update_gate(b_x, SIGMOID: tl.constexpr):
    """beta / erase / write as loaded, float32; their sigmoid with `beta_sigmoid`."""
    b_x = b_x.to(tl.float32)
    if SIGMOID:
        b_x = tl.sigmoid(b_x)
    return b_x


@triton.jit
def l2norm_rows(b_x, eps, L2NORM: tl.constexpr):
    """Rows of a float32 [R, BK] block, L2-normalised with `qk_l2norm` (else as they are)."""
    if L2NORM:
        b_x = b_x * tl.rsqrt(tl.sum(b_x * b_x, axis=1) + eps)[:, None]
    return b_x


@triton.jit
def l2norm_vector(b_x, eps, L2NORM: tl.constexpr):
    """A float32 [BK] row, L2-normalised with `qk_l2norm` (else as it is)."""
    if L2NORM:
        b_x = b_x * tl.rsqrt(tl.sum(b_x * b_x) + eps)
    return b_x


@triton.jit
def load_state_tile(S0, i_row, i_h, s_n, s_h, s_k, s_v, o_k, o_v, m_row, HAS_INIT: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr):
    """[BK, BV] float32 tile of the state at slot i_row, head i_h, read through element strides
    (slot, head, key, value): K-major and V-major alike. Zeros unless HAS_INIT; m_row masks
    the tile's bounds and a padding row (nothing is read there)."""
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INIT:
        p_s0 = S0 + i_row * s_n + i_h * s_h + o_k[:, None] * s_k + o_v[None, :] * s_v
        b_s = tl.load(p_s0, mask=m_row, other=0.0).to(tl.float32)
    return b_s


# Triton's interpreter (3.9) multiplies bfloat16 blocks as their raw bits, and truncates where a
# GPU rounds to nearest even. Under it `dot` takes the float32 product of the blocks rounded to
# bfloat16 by `_round_to_bfloat16` instead: the GPU's result up to the order of the float32 sums
# (the product of two bfloat16 values, 8-bit significands, is exact in float32); a bfloat16
# state store rounds the same way first (float16 casts already round to nearest even there).
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _round_to_bfloat16(x):
    """float32 x rounded to the nearest bfloat16 value, ties to even, kept as float32 (NaN stays NaN)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def store_state_tile(S, b_s, i_row, i_h, s_n, s_h, s_k, s_v, o_k, o_v, m_row):
    """Store a float32 [BK, BV] state tile at slot i_row, head i_h through element strides, in S's
    dtype (float32, or bfloat16 / float16 rounded to nearest even); m_row as in `load_state_tile`
    (a padding row is never written)."""
    p_s = S + i_row * s_n + i_h * s_h + o_k[:, None] * s_k + o_v[None, :] * s_v
    if _INTERPRETED and S.dtype.element_ty == tl.bfloat16:
        b_s = _round_to_bfloat16(b_s)
    tl.store(p_s, b_s.to(S.dtype.element_ty), mask=m_row)


@triton.jit
def dot(a, b, DT: tl.constexpr):
    """a @ b of float32 blocks, accumulated in float32. DT float32 (float32 inputs): exact
    float32 products (`ieee`, no tf32). DT bfloat16 (16-bit inputs): the operands are rounded
    to bfloat16 first, so the product runs on tensor cores; bfloat16 also for float16 inputs,
    for its float32 range (states and inverses are not bounded by the inputs' range)."""
    if DT == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    if _INTERPRETED:
        return tl.dot(_round_to_bfloat16(a), _round_to_bfloat16(b), input_precision="ieee")
    return tl.dot(a.to(DT), b.to(DT))


def dot_dtype(x: torch.Tensor):
    """The `dot` operand type for inputs of x's dtype."""
    return tl.float32 if x.dtype == torch.float32 else tl.bfloat16


def state_strides(x, layout: str):
    """(slot, head, key, value) element strides of a [S, H, K, V] ("kv") or [S, H, V, K] ("vk")
    state; zeros for None (the kernel then reads no state)."""
    if x is None:
        return (0, 0, 0, 0)
    s_n, s_h, s_a, s_b = x.stride()
    return (s_n, s_h, s_a, s_b) if layout == "kv" else (s_n, s_h, s_b, s_a)


def new_state(S0, state_indices, N: int, H: int, K: int, V: int, layout: str, device):
    """The state buffer the kernels write: S0 itself for a slab (in place), else a new one in
    S0's dtype (float32 without S0)."""
    if state_indices is not None:
        return S0
    shape = (N, H, K, V) if layout == "kv" else (N, H, V, K)
    return torch.empty(shape, dtype=torch.float32 if S0 is None else S0.dtype, device=device)


def gate_flags(g, gk, b, w, A_log) -> dict:
    """The constexpr flags that say which gates a call has and their forms."""
    return dict(HAS_G=g is not None, HAS_GK=gk is not None, RAW=A_log is not None,
                HAS_ERASE=b is not None, ERASE_PER_KEY=b is not None and b.dim() == 4,
                HAS_WRITE=w is not None, WRITE_PER_VALUE=w is not None and w.dim() == 4)
