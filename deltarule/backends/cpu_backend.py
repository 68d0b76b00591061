"""The `cpu` backend: the native V-tiled recurrence (`kernels/csrc/recurrent.c`).

One kernel for every call shape: prefill, decode, varlen, a slab in place,
speculative plans (per-token state rows), 16-bit state storage. A prefill
task (sequence, state head) keeps its state in value tiles that stay in the
L1 cache for the whole sequence, so scalar, per-key and GDN-2 gates cost the
same; decode and per-token stores run on whole state rows where they lie
(docs/performance.md has the measurements). Operands stay in the API's
layout: no packing of varlen sequences, no gather or scatter of slab rows, no
transpose of a "vk" state. The backend turns the call's `BatchPlan` into the
kernel's span, token-row and owner tables once per plan. CPU tensors only;
needs the compiled kernel that `pip install` builds.

Gradients: a call whose inputs require grad runs `_Recurrence`, whose forward is
the same kernel keeping chunk-start states and every token's u, and whose
backward is the native reverse kernel (`kernels/csrc/backward.c`).
"""

from __future__ import annotations

import glob
import math
import threading
import weakref

import numpy as np
import torch

from ..kernels import cpu_recurrent
from ..problem import Problem
from . import _grad, _prepare
from ._features import EVERYTHING

NAME = "cpu"
DESCRIPTION = "native V-tiled recurrence (C, POSIX threads, AVX2 / AVX-512 vectors)"
SUPPORTS = dict(EVERYTHING, devices="CPU tensors",
                gradients="native reverse kernel (kernels/csrc/backward.c), every non-slab call")
# Outputs of at least this many bytes come from `_POOL` (below): NumPy memory on
# transparent huge pages, recycled once the caller drops the tensor, so they
# cost no page faults after the first call. glibc maps every block of 32 MB and
# more afresh (its largest mmap threshold): a 32 MB prefill output cost ~25 ms of
# faults. Smaller blocks come back from malloc's heap once the threshold has
# risen, faster than the pool's bookkeeping: on the AVX2 CI machine a 1 MB
# decode state took 14 us from the pool and 1 us from torch.empty, and a B = 1
# decode call ran 187 -> 156 us with the smaller ones left to torch
# (docs/performance.md).
POOL_MIN_BYTES = 1 << 25
# The pool keeps at most this many bytes of dropped outputs for reuse.
POOL_BYTES = 1 << 30
# A call gets one thread per this many state-element steps. The helper threads are
# kept between calls, but waking one costs the caller ~10 us and it arrives 15-35 us
# later: between torch work on both cores a second thread lost 11-13 % at B = 1 decode
# (2^19 steps), broke even at B = 2 and won 17-22 % at B = 4 (docs/performance.md).
ELEMENT_STEPS_PER_THREAD = 1 << 20
# Tokens between the states a differentiable forward keeps: the backward recomputes a
# chunk's states from its start into a thread's scratch ([CHECKPOINT + 1, K, V] float32,
# 4 MB at K = V = 128, which stays in the last-level cache).
CHECKPOINT = 64
# The gradient path takes buffers of at least this many bytes from the pool: a training step
# allocates the same large buffers again and again, and fresh ones cost their page faults
# (a T = 2048 16-head backward spent ~12 % of its time clearing new pages).
GRAD_POOL_MIN_BYTES = 1 << 20


def _last_level_cache_bytes() -> int:
    """The largest CPU cache in bytes (Linux sysfs), 32 MiB where it cannot be read."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=32 << 20)


# A fresh final state is written past the caches (streaming stores) only when the call's
# states, read and written, outgrow the last-level cache: then they could not stay there
# anyway and streaming skips reading the destination in first. Smaller ones stay cached for
# whoever reads them next. On the AVX2 CI machine (32 MB L3), decode B = 1 / 2 / 4 / 8
# (16 heads, 2-16 MB of states) ran 1.3-1.4x faster with plain stores, B = 64 (128 MB)
# 1.2x faster streaming.
LAST_LEVEL_CACHE_BYTES = _last_level_cache_bytes()


def unavailable() -> str | None:
    """None when the backend runs here, else why not and what to do about it."""
    if cpu_recurrent.available():
        return None
    # setup.py's extension is optional: an install without a C compiler succeeds without it
    return ("the native kernel was not built (no C compiler at install time): reinstall with a "
            "C compiler: pip install --no-build-isolation -e .")


def available() -> bool:
    return unavailable() is None


def supports(p: Problem) -> str | None:
    if p.device.type != "cpu":
        return f"CPU tensors only, got device {p.device}"
    return None


def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    if p.requires_grad:
        x = _grad.differentiable_operands(p)
        o, S = _Recurrence.apply(p, x.q, x.k, x.v, x.g, x.gk, x.b, x.w, x.S0)
        return o.view(p.B, p.T, p.Ho, p.V).to(p.v.dtype), _grad.differentiable_state(p, S)
    # float16 / bfloat16 are widened, and qk_l2norm applied, as the kernel reads q and k
    q = p.q.contiguous().view(p.B, p.T, p.Hq // p.G, p.G, p.K)
    k = p.k.contiguous()
    v = p.v.contiguous()
    g, gk, b, w = _gates(p)

    spans, token_rows, owner = _tables(p)
    o = _empty((p.B, p.T, p.Hv, p.G, p.V), v.dtype, zero=not p.plan.covered())
    S0 = p.initial_state
    if S0 is not None and p.state_layout == "vk":
        S0 = S0.transpose(-1, -2)                    # a strided [*, Hv, K, V] view, no copy
    if p.in_place:
        S = S0
    else:
        S = _empty((p.N, p.Hv, p.V, p.K) if p.state_layout == "vk" else (p.N, p.Hv, p.K, p.V), p.state_dtype)
        if p.state_layout == "vk":
            S = S.transpose(-1, -2)
    steps = p.plan.steps * p.Hv * p.K * p.V
    threads = max(1, min(torch.get_num_threads(), steps // ELEMENT_STEPS_PER_THREAD))
    # a slab row is read back by the next step: only a fresh state that outgrows the cache streams
    state_bytes = 2 * p.N * p.Hv * p.K * p.V * p.state_dtype.itemsize
    cpu_recurrent.recurrent(q, k, v, g, gk, b, w, S0, S, o, spans=spans, token_rows=token_rows, owner=owner,
                            scale=p.scale, l2norm_eps=p.l2norm_eps if p.qk_l2norm else None,
                            stream_state=not p.in_place and state_bytes > LAST_LEVEL_CACHE_BYTES, threads=threads)

    o = o.view(p.B, p.T, p.Ho, p.V)
    if p.in_place:
        return o, p.initial_state
    return o, S.transpose(-1, -2) if p.state_layout == "vk" else S


def _gates(p: Problem):
    """(g, gk, b, w) for the kernel, contiguous. The kernel takes exp(gk + g) itself and
    reads per-channel gates in their own dtype; scalar gates, the raw-gate arm and
    `beta_sigmoid` are applied here in float32 (`_prepare`). Tensors already in the
    form the kernel reads are passed as they are (a decode step makes no copies)."""
    f32 = torch.float32
    if p.A_log is None:
        g = p.g if p.g is None or p.g.dtype == f32 else p.g.float()
        gk = p.gk
    else:
        g, gk = _prepare.log_decays(p)
    if p.beta is not None and not p.beta_sigmoid:
        b = w = p.beta if p.beta.dtype == f32 else p.beta.float()    # one scalar gate: erase = write
    elif p.retrieves and p.beta is None and not p.beta_sigmoid:
        b, w = p.erase, p.write
    else:
        b, w = _prepare.update_gates(p)
    same = w is b
    g = None if g is None else g.contiguous()
    gk = None if gk is None else gk.contiguous()
    b = None if b is None else b.contiguous()
    return g, gk, b, b if same else (None if w is None else w.contiguous())


def _tables(p: Problem):
    """(spans [N, 5] int64, token_rows [N, L] int64 or None, owner [B*T] int32 or None) for the
    kernel, kept with the plan. Span rows are (row, start, end, read row, final row): a padding
    sequence runs no step and reads and writes no state; without `initial_state` nothing is
    read. owner: the sequence whose output each token keeps (None when sequence n is row n)."""
    plan, has_init = p.plan, p.initial_state is not None

    def build():
        spans = np.array([(s.row, s.start, s.end, s.read if has_init else -1, s.final) if s.live
                          else (s.row, s.start, s.start, -1, -1) for s in plan.spans], dtype=np.int64)
        spans = torch.from_numpy(spans.reshape(-1, 5))
        token_rows = None if plan.token_rows is None else torch.from_numpy(plan.token_rows.copy())
        owner = None if plan.dense else torch.from_numpy(plan.owner())
        return spans, token_rows, owner
    return plan.cached(("cpu", has_init), build)


def _threads(p: Problem, steps: int) -> int:
    return max(1, min(torch.get_num_threads(), steps * p.Hv * p.K * p.V // ELEMENT_STEPS_PER_THREAD))


class _Recurrence(torch.autograd.Function):
    """The recurrence on `_grad.Operands` (float32, API token layout) -> (o [B, T, Hv, G, V]
    float32, S [N, Hv, K, V] float32). The forward runs the kernel once, keeping the state
    at the start of every chunk of CHECKPOINT tokens and every token's u = w*v - r (so the
    backward recomputes a chunk's states without the retrieval); the backward runs
    backward.c."""

    @staticmethod
    def forward(ctx, p, q, k, v, g, gk, b, w, S0):
        spans, first, starts, finals = _checkpoint_tables(p)
        ck = _empty((int(first[-1]), p.Hv, p.K, p.V), torch.float32, pool_from=GRAD_POOL_MIN_BYTES)
        ck[starts] = 0.0 if S0 is None else S0
        o = _empty((p.B, p.T, p.Hv, p.G, p.V), torch.float32, zero=not p.plan.covered(),
                   pool_from=GRAD_POOL_MIN_BYTES)
        u = _empty((p.B, p.T, p.Hv, p.V), torch.float32, pool_from=GRAD_POOL_MIN_BYTES)
        _, _, owner = _tables(p)
        cpu_recurrent.recurrent(q, k, v, g, gk, b, w, ck, ck, o, spans=spans, token_rows=None, owner=owner,
                                scale=p.scale, l2norm_eps=None, stream_state=False,
                                threads=_threads(p, p.plan.steps), u_out=u, checkpoint=CHECKPOINT)
        S = ck.index_select(0, finals)
        ctx.p = p
        ctx.save_for_backward(q, k, v, u, g, gk, b, w, ck)
        return o, S

    @staticmethod
    def backward(ctx, do, dS):
        p = ctx.p
        q, k, v, u, g, gk, b, w, ck = ctx.saved_tensors
        need = ctx.needs_input_grad[1:]
        B, T, Hv, K, V = p.B, p.T, p.Hv, p.K, p.V
        zero = not p.plan.covered()
        out = lambda *shape: _empty(shape, torch.float32, zero=zero, pool_from=GRAD_POOL_MIN_BYTES)  # noqa: E731
        gate = lambda x, channels: None if x is None else out(B, T, Hv, *channels[:x.dim() - 3])  # noqa: E731
        dq = out(B, T, Hv, p.G, K) if need[0] else None
        dk, dv = out(B, T, Hv, K), out(B, T, Hv, V)
        dlam = None if g is None and gk is None else out(B, T, Hv, *((K,) if gk is not None else ()))
        db, dw = gate(b, (K,)), gate(w, (V,))
        dS0 = torch.empty(p.N, Hv, K, V) if need[7] else None
        do = torch.zeros(B, T, Hv, p.G, V) if do is None else do.float().contiguous()
        dS = None if dS is None else dS.float().contiguous()
        cpu_recurrent.backward(q, k, v, u, g, gk, b, w, ck, dS, do, _backward_spans(p), dq, dk, dv, dlam, db, dw,
                               dS0, scale=p.scale, chunk=CHECKPOINT, threads=_threads(p, 4 * p.plan.steps))
        dq, dk = _grad.head_sums(p, dq, dk)
        dg = None if g is None else (dlam if gk is None else dlam.sum(-1))
        grads = (dq, dk, dv, dg, dlam if gk is not None else None, db, dw, dS0)
        return (None, *(x if n else None for x, n in zip(grads, need)))


def _checkpoint_tables(p: Problem):
    """(spans [N, 5] for the kernel, first [N + 1] int64, starts [N], finals [N] int64 tensors),
    kept with the plan: sequence n's chunk-start states lie in rows first[n] .. first[n] + its
    chunks of CHECKPOINT tokens of the checkpoint buffer, starts[n] = first[n] holding its
    initial state and finals[n] (the last) its final state; first[N] is the buffer's size. Its
    span reads row first[n] and writes the final row (an empty sequence: nothing, its final
    state is its start)."""
    def build():
        chunks = [-(-s.length // CHECKPOINT) for s in p.spans]
        first = np.zeros(p.N + 1, dtype=np.int64)
        first[1:] = np.cumsum(np.array(chunks, dtype=np.int64) + 1)
        spans = np.array([(s.row, s.start, s.end, first[n], first[n] + chunks[n]) if chunks[n]
                          else (s.row, s.start, s.start, -1, -1) for n, s in enumerate(p.spans)], dtype=np.int64)
        finals = first[:-1] + np.array(chunks, dtype=np.int64)
        return (torch.from_numpy(spans.reshape(-1, 5)), first, torch.from_numpy(first[:-1]),
                torch.from_numpy(finals))
    return p.plan.cached(("cpu checkpoints", CHECKPOINT), build)


def _backward_spans(p: Problem) -> torch.Tensor:
    """[N, 4] int64 (row, start, end, first checkpoint row) for backward.c."""
    def build():
        first = _checkpoint_tables(p)[1]
        return torch.tensor([(s.row, s.start, s.end, first[n]) for n, s in enumerate(p.spans)],
                            dtype=torch.int64).reshape(-1, 4)
    return p.plan.cached(("cpu backward spans", CHECKPOINT), build)


def _empty(shape, dtype: torch.dtype, zero: bool = False, pool_from: int | None = None) -> torch.Tensor:
    """A new tensor; those of at least `pool_from` bytes (default POOL_MIN_BYTES) from `_POOL`,
    NaN-filled like torch.empty where torch fills uninitialised memory."""
    count, size = math.prod(shape), dtype.itemsize
    if count * size < (POOL_MIN_BYTES if pool_from is None else pool_from):
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype)
    x = _POOL.take(count * size).view(dtype).view(shape)
    if zero:
        x.zero_()
    elif torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        x.fill_(float("nan"))
    return x


class _OutputPool:
    """Large output buffers, recycled when the caller drops them.

    torch's CPU allocator hands big blocks back to the operating system, so
    every fresh 32 MB output pays ~8000 page faults and the kernel's zeroing on
    first touch. Here the memory is NumPy's (which asks for transparent huge
    pages) and a buffer returns to the pool when the last tensor viewing it is
    freed, for the next output of the same size: what ONNX Runtime's arena
    does. At most `POOL_BYTES` are kept; outputs the caller keeps are never
    touched.
    """

    def __init__(self):
        self._free: dict[int, list[np.ndarray]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of nbytes; its memory comes back here when it dies."""
        with self._lock:
            blocks = self._free.get(nbytes)
            raw = blocks.pop() if blocks else None
            if raw is not None:
                self._bytes -= raw.nbytes
        if raw is None:
            raw = np.empty(nbytes + 64, dtype=np.uint8)
        start = -raw.ctypes.data % 64                 # 64-byte aligned: the kernel's streaming stores
        view = raw[start:start + nbytes]              # the tensor's own array; raw stays with the pool
        weakref.finalize(view, self._give, raw)
        return torch.from_numpy(view)

    def _give(self, raw: np.ndarray) -> None:
        with self._lock:
            if self._bytes + raw.nbytes <= POOL_BYTES:
                self._free.setdefault(raw.nbytes - 64, []).append(raw)
                self._bytes += raw.nbytes


_POOL = _OutputPool()
