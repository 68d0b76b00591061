"""Binding of the native CPU recurrence (`csrc/recurrent.c`) and its reverse mode
(`csrc/backward.c`), built by `pip install`.

One call runs every (sequence, state head) task on `threads` threads: by default a
parallel region of torch's own OpenMP runtime (`use_threads`), else POSIX helper
threads the kernel keeps between calls; see the C file for the algorithm.
Compute only: the caller passes operands in the API's token-major layout and
the int64 span table; nothing is validated here (but `check_decay`, the sign of
the log decays, which the kernel scans before any work).

`Recurrence` packs the kernel's `problem` struct once: sizes, dtypes, strides,
flags and the plan's tables; a run packs only the operands' addresses into it
(one `pack_into` of 12 pointers) and calls the kernel with the buffer's address.
A decode step's layers each run the same `Recurrence` (`backends.cpu_backend`
keeps them with the plan), so their Python cost is a few microseconds.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import struct
import threading
from dataclasses import dataclass

import torch

from .layout import BACKWARD, CONV, PROBLEM

ABSENT, SCALAR, CHANNEL = 0, 1, 2        # gate forms, as in recurrent.c
TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}   # element types, as in recurrent.c
OK, NO_MEMORY, POSITIVE_G, POSITIVE_GK, SHARED = 0, 1, 2, 3, 4      # deltarule_recurrent's results

# a run repacks the operands' addresses, the struct's first fields
_OPERANDS = PROBLEM.leading("q", "k", "v", "g", "gk", "b", "w", "a_log", "dt_bias", "s0", "s", "o")
_BAD = PROBLEM.offset("bad")
_NO_STRIDES = (0, 0, 0, 0)


def _load():
    # DELTARULE_CPU_KERNEL: a path to load instead of the built extension (CI's sanitizer
    # build, .ci/sanitize); a missing file is an error, never a silent fallback
    path = os.environ.get("DELTARULE_CPU_KERNEL")
    if not path:
        spec = importlib.util.find_spec("deltarule.kernels.cpu._native")
        if spec is None or spec.origin is None:
            return None
        path = spec.origin
    lib = ctypes.CDLL(path)
    lib.deltarule_recurrent.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.deltarule_recurrent.restype = ctypes.c_int
    lib.deltarule_backward.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.deltarule_backward.restype = ctypes.c_int
    lib.deltarule_conv.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.deltarule_conv.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.deltarule_replay.argtypes = [ptr, ctypes.c_int, ctypes.c_int, ptr, ptr, ptr] + [i64] * 7
    lib.deltarule_replay.restype = ctypes.c_int
    lib.deltarule_use_host_threads.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.deltarule_use_host_threads.restype = None
    lib.deltarule_team_state.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.deltarule_team_state.restype = None
    lib.deltarule_team_hold.argtypes = [ctypes.c_uint]
    lib.deltarule_team_hold.restype = None
    lib.deltarule_team_adapt.argtypes = [ctypes.c_int]
    lib.deltarule_team_adapt.restype = ctypes.c_int
    PROBLEM.check(lib.deltarule_problem_fields)
    BACKWARD.check(lib.deltarule_backward_problem_fields)
    CONV.check(lib.deltarule_conv_problem_fields)
    return lib


_LIB = _load()
THREADS = ("openmp", "own")


def _torch_openmp() -> tuple[int, int] | None:
    """The addresses of GOMP_parallel and omp_get_thread_num in the OpenMP runtime torch's
    parallel regions run on, or None (torch built without OpenMP). libtorch_cpu binds them
    from the global scope first (a preloaded libiomp5 / libomp), else from its own
    dependency (the libgomp its wheel bundles): looked up in that order."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    for lib in (ctypes.CDLL(None), ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib",
                                                             "libtorch_cpu.so"))):
        try:
            return (ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value,
                    ctypes.cast(lib.omp_get_thread_num, ctypes.c_void_p).value)
        except (AttributeError, OSError):
            continue
    return None


def use_threads(kind: str) -> str:
    """Which threads run the kernels' parallel work (the recurrence's tasks, the conv's blocks):
    "openmp", torch's own OpenMP thread pool (the threads of its GEMMs; the default, from
    env DELTARULE_CPU_THREADS, where torch runs on OpenMP), or "own", threads the kernels keep.
    Either way a contended machine makes small calls run on the calling thread alone for a
    while (`contention`; csrc/team.h). Returns the kind in effect ("own" where torch has no
    OpenMP runtime). Not while a kernel call runs. Results are the same bits either way.

    >>> from deltarule.kernels.cpu import recurrent as cpu_recurrent
    >>> cpu_recurrent.use_threads("own")
    'own'
    >>> cpu_recurrent.use_threads("openmp")         # torch's pool (torch's CPU wheels run on OpenMP)
    'openmp'
    """
    if kind not in THREADS:
        raise ValueError(f"threads: one of {THREADS}, not {kind!r}")
    runtime = _torch_openmp() if kind == "openmp" else None
    _LIB.deltarule_use_host_threads(*(runtime or (None, None)))
    global _THREADS
    _THREADS = "openmp" if runtime else "own"
    return _THREADS


def threads_in_use() -> str:
    """The kind `use_threads` put in effect."""
    return _THREADS


@dataclass(frozen=True)
class Contention:
    """The kernels' view of the machine (csrc/team.h): `stalls`, parallel calls since the last
    `adapt_to_contention` whose caller waited for a helper the scheduler had not run (longer than
    its own work and than 1 ms); `solo_s` and `solo_calls`, how long and for how many more
    small calls those run on the calling thread alone (both must run out: after two stalls in a
    row close together); `period_s`, the last such period (0.1 s and 64 calls, doubling while
    close stalls keep coming, up to 2 s and 4096);
    `held_arrivals`, helpers that arrived at a call while `hold_helpers` held them."""

    stalls: int
    solo_s: float
    period_s: float
    solo_calls: int
    held_arrivals: int


def contention() -> Contention:
    """The kernels' current `Contention` (process-wide).

    >>> from deltarule.kernels.cpu import recurrent as cpu_recurrent
    >>> cpu_recurrent.contention().stalls >= 0
    True
    """
    out = (ctypes.c_int64 * 5)()
    _LIB.deltarule_team_state(out)
    return Contention(out[0], out[1] / 1e9, out[2] / 1e9, out[3], out[4])


def adapt_to_contention(on: bool) -> bool:
    """Whether small calls fall back to the calling thread alone after a stall (the default: on).
    Off, every call runs on the threads it is given, as on a machine whose cores are the
    process's own. Either way the state starts afresh (no stall seen). Returns the previous
    setting. Not while a kernel call runs.

    >>> from deltarule.kernels.cpu import recurrent as cpu_recurrent
    >>> was = cpu_recurrent.adapt_to_contention(True)
    >>> cpu_recurrent.contention().stalls
    0
    """
    return bool(_LIB.deltarule_team_adapt(int(on)))


def hold_helpers(mask: int) -> None:
    """For tests: helper threads whose bit (1 << thread number, 1 and up; 0 is the caller) is set
    in `mask` stay out of calls until a later call clears it, as helpers the scheduler does not
    run. 0 releases them all."""
    _LIB.deltarule_team_hold(mask)


_THREADS = "own"
if _LIB is not None:
    _kind = os.environ.get("DELTARULE_CPU_THREADS", "openmp")
    if _kind not in THREADS:
        raise ValueError(f"DELTARULE_CPU_THREADS: one of {THREADS}, not {_kind!r}")
    use_threads(_kind)
    # GNU OpenMP's threads do not survive fork (a child's next parallel region waits for them
    # forever, torch's too): a forked child starts on the kernel's own threads, which do.
    # use_threads("openmp") in the child takes the pool again (the vLLM plugin does: vLLM's
    # processes run torch's parallel regions anyway).
    os.register_at_fork(after_in_child=lambda: use_threads("own"))


def available() -> bool:
    return _LIB is not None


class Recurrence:
    """One kernel call's `problem`, packed once; `run` supplies the operands.

    The constructor takes example operands (their shapes, dtypes and strides are
    fixed from then on; every later run's operands must match them) and the
    tables, which it keeps alive:

    q [B, T, Hq', G, K], k [B, T, Hk, K] contiguous, one dtype of TYPES;
    v [B, T, Hv, V] contiguous, a dtype of TYPES (Hq' and Hk divide Hv; G query
    heads per state head);
    g None | [B, T, Hv], gk None | [B, T, Hv, K]: log decays (the kernel takes
    exp(gk + g)), or with `raw_gate` the raw projection of the one present and
    a_log [Hv], dt_bias [Hv] (beside g) or [Hv, K] (beside gk): the log decay is
    -exp(a_log) softplus(x + dt_bias);
    b None | [B, T, Hv] | [B, T, Hv, K]  erase; w None | [B, T, Hv] | [B, T, Hv, V]
    write (`gate_sigmoid`: their sigmoid is used); every gate contiguous, any
    dtype of TYPES;
    S0 None (every sequence starts from zeros) | [*, Hv, K, V], any strides, a
    dtype of TYPES (widened to float32 when read); S [*, Hv, K, V], any strides,
    a dtype of TYPES (may be S0 itself: a slab updated in place); every store
    into S rounds to nearest even;
    o [B, T, Hv, G, V] contiguous in v's dtype;
    spans [N, 5] int64 contiguous: (batch row, start, end, read row of S0 or -1
    for zeros, final row of S or -1 for none); a padding sequence has start ==
    end and both rows -1;
    token_rows None | [N, W] int64 contiguous, W >= every span's length: after
    token t of sequence n (t < end - start), the state is stored into row
    token_rows[n, t] of S where that is >= 0 (speculative decoding's per-token
    states); columns past a span's length are ignored. The final row is stored
    as well where spans says so. Rows written by different sequences must be
    distinct, and no sequence may read a row another writes; a sequence's read
    row may be one of its own token rows (every read of a (sequence, head)
    happens before its first write);
    owner None | [B*T] int32: the span whose output a token keeps (-1: none);
    l2norm_eps: None, or L2-normalise q and k rows (x / sqrt(sum x^2 + eps)) as
    they are read;
    check_decay: refuse a positive log decay in g or gk (not with raw_gate)
    before any work: `run` returns POSITIVE_G / POSITIVE_GK and `bad` holds the
    flat index of the first;
    slab_bytes > 0 (S is S0, a slab in place): refuse an operand among q, k, v, g,
    gk, b, w, a_log, dt_bias whose bytes [p, p + operand_bytes[i]) meet S's
    [S, S + slab_bytes) before any work: `run` returns SHARED, `bad` = i;
    stream_state: write the final states with streaming stores (past the
    caches; for a fresh state, never for a slab in place); token rows always go
    past the caches where they are 64-byte aligned, except into the row the
    sequence reads;
    prefetch_next: while a task runs, prefetch the next one's state (worth it for
    states beyond the per-core cache);
    u_out: None | [B, T, Hv, V] float32 contiguous: receives u = w*v - S'^T (b*k)
    of every token the spans run (what `backward` recomputes the states from);
    checkpoint: 0, or a multiple of 16: a span of more than one token also
    stores its state after every `checkpoint` tokens but its last into rows
    read + 1, read + 2, ... of S (a differentiable forward's chunk starts, S
    being S0; `backward`'s `ck`);
    capture: None | [N, C * (Dw + Hk*K + Hv*V)] float32 contiguous (Dw = Hv*K
    with gk, else Hv; C = `capacity` >= 1), written in place: for each span n
    and its first min(C, end - start) tokens i, row n receives at
    i*Dw the decay factors exp(lam) the update applies (after the raw-gate
    arm; 1 without decay; [Hv] or [Hv, K] flat), at C*Dw + i*Hk*K the key
    after the L2 norm [Hk, K], and at C*(Dw + Hk*K) + i*Hv*V its u = w*v -
    S'^T (b*k) [Hv, V] (ONNX Runtime's GatedDeltaNet `state_update` layout);
    every other element is left as it is. Kept alive by the Recurrence: the
    buffer is fixed at construction (a capture call packs a Recurrence of its
    own, never a kept launch).
    """

    def __init__(self, q, k, v, g, gk, b, w, a_log, dt_bias, S0, S, o, spans, token_rows, owner, *,
                 scale: float, l2norm_eps: float | None, raw_gate: bool = False, gate_sigmoid: bool = False,
                 check_decay: bool = False, stream_state: bool = False, prefetch_next: bool = False,
                 u_out=None, checkpoint: int = 0, capture=None, capacity: int = 0,
                 slab_bytes: int = 0, operand_bytes: tuple[int, ...] = (0,) * 9):
        B, T, Hv, V = v.shape
        self._keep = (spans, token_rows, owner, u_out, capture)    # the tables the struct points to
        self._bad = torch.zeros(1, dtype=torch.int64)
        rows, cols = (0, 0) if token_rows is None else (token_rows.data_ptr(), token_rows.shape[1])
        q_, k_, v_, g_, gk_, b_, w_, a_log_, dt_bias_, s0_, s_, o_ = operands(q, k, v, g, gk, b, w, a_log, dt_bias,
                                                                         S0, S, o)
        self._buf = PROBLEM.pack(
            q=q_, k=k_, v=v_, g=g_, gk=gk_, b=b_, w=w_, a_log=a_log_, dt_bias=dt_bias_, s0=s0_, s=s_, o=o_,
            bad=self._bad.data_ptr(), spans=spans.data_ptr(), token_rows=rows, owner=_ptr(owner), u_out=_ptr(u_out),
            capture=_ptr(capture), N=spans.shape[0], T=T, Hv=Hv, K=k.shape[3], V=V, G=q.shape[3],
            rq=Hv // q.shape[2], rk=Hv // k.shape[2], token_cols=cols, tokens=B * T, checkpoint=checkpoint,
            capacity=0 if capture is None else capacity,
            s0_stride=_NO_STRIDES if S0 is None else S0.stride(), s_stride=S.stride(), slab_bytes=slab_bytes,
            operand_bytes=operand_bytes, b_form=_form(b), w_form=_form(w), qk_type=TYPES[q.dtype],
            v_type=TYPES[v.dtype], g_type=_type(g), gk_type=_type(gk), b_type=_type(b), w_type=_type(w),
            s0_type=0 if S0 is None else TYPES[S0.dtype], s_type=TYPES[S.dtype], a_type=_type(a_log),
            dtb_type=_type(dt_bias), raw_gate=bool(raw_gate), gate_sigmoid=bool(gate_sigmoid),
            check_decay=bool(check_decay), stream_state=bool(stream_state), prefetch_next=bool(prefetch_next),
            qk_l2norm=l2norm_eps is not None, l2norm_eps=0.0 if l2norm_eps is None else l2norm_eps, scale=scale)
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._buf))
        self._busy = threading.Lock()

    @property
    def bad(self) -> int:
        """After a run that returned POSITIVE_G / POSITIVE_GK: the flat index of the first
        positive log decay in g / gk."""
        return int(self._bad[0])

    def run(self, pointers: tuple[int, ...], threads: int) -> int:
        """Runs the recurrence on the operands at these addresses (`operands`; shapes, dtypes
        and strides as the constructor's); writes o and the states the tables name. Returns
        OK, or POSITIVE_G / POSITIVE_GK / SHARED (nothing was written; `bad` says where);
        raises MemoryError. Thread-safe: a call that finds the buffer in use by another
        thread's call (the kernel releases the GIL) packs a private copy of it."""
        if not self._busy.acquire(False):
            return self._run_private(pointers, threads)
        try:
            _OPERANDS.pack_into(self._buf, 0, *pointers)
            return self._result(_LIB.deltarule_recurrent(self._address, threads))
        finally:
            self._busy.release()

    def run_packed(self, threads: int) -> int:
        """`run` on the operands the constructor took (the caller keeps them alive); not
        thread-safe (one caller: a differentiable forward's own `Recurrence`)."""
        return self._result(_LIB.deltarule_recurrent(self._address, threads))

    def _run_private(self, pointers, threads: int) -> int:
        buf = bytearray(self._buf)
        bad = torch.zeros(1, dtype=torch.int64)
        _OPERANDS.pack_into(buf, 0, *pointers)
        struct.pack_into("@P", buf, _BAD, bad.data_ptr())
        result = self._result(_LIB.deltarule_recurrent(ctypes.addressof(ctypes.c_char.from_buffer(buf)), threads))
        if result != OK:
            self._bad.copy_(bad)
        return result

    @staticmethod
    def _result(result: int) -> int:
        if result == NO_MEMORY:
            raise MemoryError("deltarule cpu kernel: no memory for a thread's tile buffer")
        return result


def operands(q, k, v, g, gk, b, w, a_log, dt_bias, S0, S, o) -> tuple[int, ...]:
    """The operands' addresses, in `Recurrence.run`'s order (0 for an absent one). Written out
    (no `_ptr` calls): a decode step's every layer packs them."""
    return (q.data_ptr(), k.data_ptr(), v.data_ptr(), 0 if g is None else g.data_ptr(),
            0 if gk is None else gk.data_ptr(), 0 if b is None else b.data_ptr(),
            0 if w is None else w.data_ptr(), 0 if a_log is None else a_log.data_ptr(),
            0 if dt_bias is None else dt_bias.data_ptr(), 0 if S0 is None else S0.data_ptr(),
            S.data_ptr(), o.data_ptr())


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
    packed = BACKWARD.pack(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), u=u.data_ptr(), g=_ptr(g), gk=_ptr(gk), b=_ptr(b), w=_ptr(w),
        ck=ck.data_ptr(), ds=_ptr(ds), dout=do.data_ptr(), spans=spans.data_ptr(), dq=_ptr(dq), dk=dk.data_ptr(),
        dv=dv.data_ptr(), dlam=_ptr(dlam), db=_ptr(db), dw=_ptr(dw), ds0=_ptr(ds0), N=spans.shape[0], T=T, Hv=Hv,
        K=k.shape[3], V=V, G=q.shape[3], rq=Hv // q.shape[2], rk=Hv // k.shape[2], chunk=chunk, b_form=_form(b),
        w_form=_form(w), scale=scale)
    if _LIB.deltarule_backward(bytes(packed), threads):
        raise MemoryError("deltarule cpu kernel: no memory for a backward thread's scratch")


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _type(x: torch.Tensor | None) -> int:
    return 0 if x is None else TYPES[x.dtype]


def _form(x: torch.Tensor | None) -> int:
    if x is None:
        return ABSENT
    return CHANNEL if x.dim() == 4 else SCALAR
