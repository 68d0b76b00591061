"""Binding of the native CPU recurrence (`csrc/recurrent.c`, built by `pip install`).

One call runs every (sequence, state head, 64-column value tile) task on
`threads` OpenMP threads; see the C file for the algorithm. Compute only: the
caller passes contiguous float32 operands in the API's token-major layout and
the int64 span table; nothing is validated here.
"""

from __future__ import annotations

import ctypes
import importlib.util

import torch

ABSENT, SCALAR, CHANNEL = 0, 1, 2        # gate forms, as in recurrent.c
TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}   # element types, as in recurrent.c


class _Problem(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in ("q", "k", "v", "g", "gk", "b", "w", "s0", "s", "o",
                                                      "spans", "owner")]
                + [(name, ctypes.c_int64) for name in ("N", "T", "Hv", "K", "V", "G", "rq", "rk")]
                + [(name, ctypes.c_int64 * 4) for name in ("s0_stride", "s_stride")]
                + [(name, ctypes.c_int) for name in ("b_form", "w_form", "qk_type", "v_type", "gk_type",
                                                     "b_type", "w_type",
                                                     "stream_state", "qk_l2norm")]
                + [(name, ctypes.c_float) for name in ("l2norm_eps", "scale")])


def _load():
    spec = importlib.util.find_spec("deltarule.kernels._recurrent_cpu")
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.deltarule_recurrent.argtypes = [ctypes.POINTER(_Problem), ctypes.c_int]
    lib.deltarule_recurrent.restype = ctypes.c_int
    return lib


_LIB = _load()


def available() -> bool:
    return _LIB is not None


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _type(x: torch.Tensor | None) -> int:
    return 0 if x is None else TYPES[x.dtype]


def _form(x: torch.Tensor | None, channel_dim: int) -> int:
    if x is None:
        return ABSENT
    return CHANNEL if x.dim() == channel_dim else SCALAR


def recurrent(q, k, v, g, gk, b, w, S0, S, o, spans, owner, scale: float, l2norm_eps: float | None,
              stream_state: bool, threads: int) -> None:
    """Runs the recurrence; writes o and the final states.

    q [B, T, Hq', G, K], k [B, T, Hk, K] contiguous, one dtype of TYPES;
    v [B, T, Hv, V] contiguous, a dtype of TYPES (Hq' and Hk divide Hv; G
    query heads per state head);
    g None | [B, T, Hv] float32, gk None | [B, T, Hv, K] (a dtype of TYPES)  log decays
    (the kernel takes exp(gk + g));
    b None | [B, T, Hv] | [B, T, Hv, K]  erase; w None | [B, T, Hv] | [B, T, Hv, V]  write
    (scalar forms float32, per-channel forms a dtype of TYPES);
    S0 [*, Hv, K, V] (any strides; None: every sequence starts from zeros) and
    S [*, Hv, K, V] (any strides; may be S0 itself, a slab updated in place)
    are indexed by the spans' slots; o [B, T, Hv, G, V] contiguous in v's dtype;
    spans [N, 5] int64 (row, start, end, initial slot or -1, final slot or -1);
    owner None | [B*T] int32: the span whose output a token keeps (-1: none);
    l2norm_eps: None, or L2-normalise q and k rows (x / sqrt(sum x^2 + eps)) as they are read;
    stream_state: write S with streaming stores (past the caches; never for a slab in place).
    """
    B, T, Hv, V = v.shape
    K = k.shape[3]
    s0_stride = S0.stride() if S0 is not None else (0, 0, 0, 0)   # never read without S0
    P = _Problem(
        _ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(gk), _ptr(b), _ptr(w), _ptr(S0), _ptr(S), _ptr(o),
        _ptr(spans), _ptr(owner),
        spans.shape[0], T, Hv, K, V, q.shape[3], Hv // q.shape[2], Hv // k.shape[2],
        (ctypes.c_int64 * 4)(*s0_stride), (ctypes.c_int64 * 4)(*S.stride()),
        _form(b, 4), _form(w, 4), TYPES[q.dtype], TYPES[v.dtype], _type(gk), _type(b), _type(w),
        stream_state, l2norm_eps is not None, 0.0 if l2norm_eps is None else l2norm_eps, scale)
    if _LIB.deltarule_recurrent(ctypes.byref(P), threads):
        raise MemoryError("deltarule cpu kernel: no memory for a thread's tile buffer")
