"""Binding of the native CPU recurrence (`csrc/recurrent.c`) and its reverse mode
(`csrc/backward.c`), built by `pip install`.

One call runs every (sequence, state head) task on `threads` POSIX threads (the
caller's and helpers kept between calls); see the C file for the algorithm.
Compute only: the caller passes operands in the API's token-major layout and
the int64 span table; nothing is validated here.

The call packs the kernel's `problem` struct with one `struct.pack` (a few
microseconds; a ctypes.Structure built field by field cost ~14 us per call,
which a B = 1 decode notices).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import struct

import torch

ABSENT, SCALAR, CHANNEL = 0, 1, 2        # gate forms, as in recurrent.c
TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}   # element types, as in recurrent.c

# recurrent.c's `problem`, field by field in native alignment:
# q k v g gk b w s0 s o spans token_rows owner u_out (pointers);
# N T Hv K V G rq rk token_cols checkpoint, s0_stride[4], s_stride[4] (int64);
# b_form w_form qk_type v_type gk_type b_type w_type s0_type s_type stream_state qk_l2norm (int);
# l2norm_eps scale (float)
_PROBLEM = struct.Struct("@14P18q11i2f")
_NO_STRIDES = (0, 0, 0, 0)
# backward.c's `bproblem`: q k v u g gk b w ck ds dout spans dq dk dv dlam db dw ds0 (pointers);
# N T Hv K V G rq rk chunk (int64); b_form w_form (int); scale (float)
_BACKWARD = struct.Struct("@19P9q2if")


def _load():
    # DELTARULE_CPU_KERNEL: a path to load instead of the built extension (CI's sanitizer
    # build, .ci/sanitize); a missing file is an error, never a silent fallback
    path = os.environ.get("DELTARULE_CPU_KERNEL")
    if not path:
        spec = importlib.util.find_spec("deltarule.kernels._recurrent_cpu")
        if spec is None or spec.origin is None:
            return None
        path = spec.origin
    lib = ctypes.CDLL(path)
    lib.deltarule_recurrent.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.deltarule_recurrent.restype = ctypes.c_int
    lib.deltarule_problem_size.restype = ctypes.c_size_t
    lib.deltarule_backward.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.deltarule_backward.restype = ctypes.c_int
    lib.deltarule_backward_problem_size.restype = ctypes.c_size_t
    if (lib.deltarule_problem_size() != struct.calcsize(_PROBLEM.format + "0q")
            or lib.deltarule_backward_problem_size() != struct.calcsize(_BACKWARD.format + "0q")):
        raise ImportError("deltarule cpu kernel: the binding's problem layout does not match the C files "
                          "(rebuild: pip install --no-build-isolation -e .)")
    return lib


_LIB = _load()


def available() -> bool:
    return _LIB is not None


def recurrent(q, k, v, g, gk, b, w, S0, S, o, spans, token_rows, owner, scale: float,
              l2norm_eps: float | None, stream_state: bool, threads: int, u_out=None,
              checkpoint: int = 0) -> None:
    """Runs the recurrence; writes o and the states that spans and token_rows name.

    q [B, T, Hq', G, K], k [B, T, Hk, K] contiguous, one dtype of TYPES;
    v [B, T, Hv, V] contiguous, a dtype of TYPES (Hq' and Hk divide Hv; G
    query heads per state head);
    g None | [B, T, Hv] float32, gk None | [B, T, Hv, K] (a dtype of TYPES)  log decays
    (the kernel takes exp(gk + g));
    b None | [B, T, Hv] | [B, T, Hv, K]  erase; w None | [B, T, Hv] | [B, T, Hv, V]  write
    (scalar forms float32, per-channel forms a dtype of TYPES);
    S0 None (every sequence starts from zeros) | [*, Hv, K, V], any strides, a dtype of TYPES
    (widened to float32 when read); S [*, Hv, K, V], any strides, a dtype of TYPES (may be S0
    itself: a slab updated in place); every store into S rounds to nearest even;
    o [B, T, Hv, G, V] contiguous in v's dtype;
    spans [N, 5] int64 contiguous: (batch row, start, end, read row of S0 or -1 for zeros,
    final row of S or -1 for none); a padding sequence has start == end and both rows -1;
    token_rows None | [N, W] int64 contiguous, W >= every span's length: after token t of
    sequence n (t < end - start), the state is stored into row token_rows[n, t] of S where
    that is >= 0 (speculative decoding's per-token states); columns past a span's length
    are ignored. The final row is stored as well where spans says so. Rows written by
    different sequences must be distinct, and no sequence may read a row another writes; a
    sequence's read row may be one of its own token rows (every read of a (sequence, head)
    happens before its first write);
    owner None | [B*T] int32: the span whose output a token keeps (-1: none);
    l2norm_eps: None, or L2-normalise q and k rows (x / sqrt(sum x^2 + eps)) as they are read;
    stream_state: write the final states with streaming stores (past the caches; for a
    fresh state, never for a slab in place); token rows always go past the caches where
    they are 64-byte aligned, except into the row the sequence reads;
    threads: threads to use, the caller's included (at most one per (sequence, head));
    u_out: None | [B, T, Hv, V] float32 contiguous: receives u = w*v - S'^T (b*k) of every
    token the spans run (what `backward` recomputes the states from);
    checkpoint: 0, or a multiple of 16: a span of more than one token also stores its state
    after every `checkpoint` tokens but its last into rows read + 1, read + 2, ... of S
    (a differentiable forward's chunk starts, S being S0; `backward`'s `ck`).
    """
    B, T, Hv, V = v.shape
    s0_type = 0
    if S0 is None:
        s0, s0_stride = 0, _NO_STRIDES                 # never read without S0
    else:
        s0, s0_stride, s0_type = S0.data_ptr(), S0.stride(), TYPES[S0.dtype]
    if token_rows is None:
        rows, cols = 0, 0
    else:
        rows, cols = token_rows.data_ptr(), token_rows.shape[1]
    packed = _PROBLEM.pack(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), _ptr(g), _ptr(gk), _ptr(b), _ptr(w), s0, S.data_ptr(),
        o.data_ptr(), spans.data_ptr(), rows, _ptr(owner), _ptr(u_out),
        spans.shape[0], T, Hv, k.shape[3], V, q.shape[3], Hv // q.shape[2], Hv // k.shape[2], cols, checkpoint,
        *s0_stride, *S.stride(),
        _form(b), _form(w), TYPES[q.dtype], TYPES[v.dtype], _type(gk), _type(b), _type(w), s0_type,
        TYPES[S.dtype], bool(stream_state), l2norm_eps is not None,
        0.0 if l2norm_eps is None else l2norm_eps, scale)
    if _LIB.deltarule_recurrent(packed, threads):
        raise MemoryError("deltarule cpu kernel: no memory for a thread's tile buffer")


def backward(q, k, v, u, g, gk, b, w, ck, ds, do, spans, dq, dk, dv, dlam, db, dw, ds0, scale: float,
             chunk: int, threads: int) -> None:
    """The reverse mode of `recurrent`: writes the gradients of every span's tokens.

    Every tensor float32 and contiguous. q, k, v, g, gk, b, w as for `recurrent` (b and w
    in their scalar or per-channel form; the preprocessing already applied); u [B, T, Hv, V]
    the forward's `u_out`;
    ck [R, Hv, K, V]: the state at the start of each chunk of `chunk` tokens, sequence n's
    chunk c in row spans[n, 3] + c; ds None | [N, Hv, K, V] the final states' gradient;
    do [B, T, Hv, G, V] the output's gradient (tokens a sequence does not own: zero);
    spans [N, 4] int64 contiguous: (batch row, start, end, first checkpoint row), spans
    not overlapping. Outputs, per state head, written for every token of a span (the
    rest is left as it is): dq None | [B, T, Hv, G, K]; dk [B, T, Hv, K]; dv [B, T, Hv, V];
    dlam [B, T, Hv, K] with g or gk (the gradient of their sum), else None; db
    [B, T, Hv, K] with b, dw [B, T, Hv, V] with w, else None; ds0 None | [N, Hv, K, V]
    (written for every sequence).
    """
    B, T, Hv, V = v.shape
    packed = _BACKWARD.pack(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), u.data_ptr(), _ptr(g), _ptr(gk), _ptr(b), _ptr(w), ck.data_ptr(),
        _ptr(ds),
        do.data_ptr(), spans.data_ptr(), _ptr(dq), dk.data_ptr(), dv.data_ptr(), _ptr(dlam), _ptr(db), _ptr(dw),
        _ptr(ds0), spans.shape[0], T, Hv, k.shape[3], V, q.shape[3], Hv // q.shape[2], Hv // k.shape[2], chunk,
        _form(b), _form(w), scale)
    if _LIB.deltarule_backward(packed, threads):
        raise MemoryError("deltarule cpu kernel: no memory for a backward thread's scratch")


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _type(x: torch.Tensor | None) -> int:
    return 0 if x is None else TYPES[x.dtype]


def _form(x: torch.Tensor | None) -> int:
    if x is None:
        return ABSENT
    return CHANNEL if x.dim() == 4 else SCALAR
