"""The `cpu` backend: the native V-tiled recurrence (`kernels/cpu/csrc/recurrent.c`).

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
backward is the native reverse kernel (`kernels/cpu/csrc/backward.c`).
"""

from __future__ import annotations

import glob
import math
import threading
import weakref
from typing import Optional

import numpy as np
import torch

from .. import aliasing
from ..errors import positive_log_decay
from ..kernels.cpu import recurrent as cpu_recurrent
from ..problem import Problem
from . import _grad
from ._features import EVERYTHING

NAME = "cpu"
DESCRIPTION = "native V-tiled recurrence (C, torch's OpenMP threads, AVX2 / AVX-512 vectors)"
SUPPORTS = dict(EVERYTHING, devices="CPU tensors",
                gradients="native reverse kernel (kernels/cpu/csrc/backward.c), every non-slab call")
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
# A call gets one thread per this many state-element steps (a token's update of one state
# element; 2^19 for a 16-head B = 1 decode step at K = V = 128). Measured on the 2-core
# AVX-512 VM with the kernel's helpers (they keep their heads call after call and spin
# through short gaps between calls; recurrent.c): a second thread took a B = 1 step from
# 52 to 35 us back to back, 25 to 19 us at 8 heads (2^18), and only 12.9 to 11.5 us at 4
# heads; with a 0.1 ms two-thread GEMM between calls it still won (docs/performance.md).
ELEMENT_STEPS_PER_THREAD = 1 << 18
# Tokens between the states a differentiable forward keeps: the backward recomputes a
# chunk's states from its start into a thread's scratch ([CHECKPOINT + 1, K, V] float32,
# 4 MB at K = V = 128, which stays in the last-level cache).
CHECKPOINT = 64
# The gradient path takes buffers of at least this many bytes from the pool: a training step
# allocates the same large buffers again and again, and fresh ones cost their page faults
# (a T = 2048 16-head backward spent ~12 % of its time clearing new pages).
GRAD_POOL_MIN_BYTES = 1 << 20


def _cache_bytes() -> dict[int, int]:
    """{cache level: the largest size in bytes at that level} of cpu0 (Linux sysfs; {} where it
    cannot be read)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes: dict[int, int] = {}
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
            with open(path[:-len("size")] + "level") as f:
                level = int(f.read())
        except (OSError, ValueError):
            continue
        size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        sizes[level] = max(size, sizes.get(level, 0))
    return sizes


# A fresh final state is written past the caches (streaming stores) only when the call's
# states, read and written, outgrow the last-level cache: then they could not stay there
# anyway and streaming skips reading the destination in first. Smaller ones stay cached for
# whoever reads them next. On the AVX2 CI machine (32 MB L3), decode B = 1 / 2 / 4 / 8
# (16 heads, 2-16 MB of states) ran 1.3-1.4x faster with plain stores, B = 64 (128 MB)
# 1.2x faster streaming.
LAST_LEVEL_CACHE_BYTES = max(_cache_bytes().values(), default=32 << 20)
# A task prefetches the next one's state only when the call's states outgrow the per-core L2:
# while they fit, the prefetched lines only displace the current task's (B = 1 decode, 1 MB of
# states: 5-10 % faster without), beyond it they hide the next state's misses (B = 64 from the
# L3: 28-38 % slower without; docs/performance.md).
L2_BYTES = _cache_bytes().get(2, 1 << 20)


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
        o, S, _, _ = _Recurrence.apply(p, x.q, x.k, x.v, x.g, x.gk, x.b, x.w, x.S0)
        return o.view(p.B, p.T, p.Ho, p.V).to(p.v.dtype), _grad.differentiable_state(p, S)
    launch = Launch(p, per_call_checks=False)          # validate has checked this call
    return launch(p.q, p.k, p.v, p.g, p.gk, p.beta, p.erase, p.write, p.A_log, p.dt_bias, p.initial_state)


def launch(p: Problem) -> "Launch | None":
    """The backend protocol's kept launch (`backends.launch`): one that checks per call what
    validation reads from values and addresses; None for a call that needs gradients or captures
    (a launch writes the capture buffer it was made with: a later call must not)."""
    return None if p.requires_grad or p.capture is not None else Launch(p, per_call_checks=True)


class Launch:
    """A validated call's kernel launch, minus its tensors: what the shapes, dtypes and strides
    of the call's tensors, its scalars and its plan fix (the packed kernel `problem`, the
    outputs' shapes, the thread count). Calling it with tensors of those shapes, dtypes and
    strides runs the kernel on them; the eager engine (`deltarule.engine`) keeps one per call
    signature with a reused plan, so a decode step's layers skip the validation and the packing.

    The gates go to the kernel as they are, in their own dtype: the raw-gate arm (A_log,
    dt_bias), the sigmoid of `beta_sigmoid` and qk_l2norm are applied in the kernel. The
    kernel reads operands where they lie: o is allocated [B, T, Ho, V] (the kernel's
    [B, T, Hv, G, V]), a "vk" state through its strides; inputs that are not contiguous are
    copied first.

    `per_call_checks`: check, on every call, what validation reads from the values and addresses
    of the tensors rather than their shapes: the sign of the log decays (in the kernel, before
    any work) and a slab's overlap with the inputs (their address ranges). For a launch kept
    for later calls; a call `validate` has just checked passes False.

    A call with `p.capture` ([N, C * (Dw + Hk*K + Hv*V)] float32) makes a launch that writes
    that buffer in place on every run (the kernel's compact capture: the first min(C, length)
    transitions of each live sequence); such a launch is never kept (`launch`). The cpu kernel
    is token-serial on every path, so `p.token_serial` needs nothing more; with a slab, the
    verify plan's final and token rows are all -1 and no slab row is written."""

    def __init__(self, p: Problem, per_call_checks: bool):
        self.o_shape, self.o_dtype, self.zero_o = (p.B, p.T, p.Ho, p.V), p.v.dtype, not p.plan.covered()
        self.small_o = not self.zero_o and p.B * p.T * p.Ho * p.V * p.v.dtype.itemsize < POOL_MIN_BYTES
        self.in_place = p.in_place
        self.state_shape = (p.N, p.Hv, p.V, p.K) if p.state_layout == "vk" else (p.N, p.Hv, p.K, p.V)
        self.state_dtype = p.state_dtype
        steps = p.plan.steps * p.Hv * p.K * p.V
        self.threads = max(1, steps // ELEMENT_STEPS_PER_THREAD)    # the work's; torch's count is read per call
        inputs = (p.q, p.k, p.v, p.g, p.gk, p.beta, p.erase, p.write, p.A_log, p.dt_bias)
        self.copy = not all(x is None or x.is_contiguous() for x in inputs)
        q, k, v, g, gk, beta, erase, write, a_log, dt_bias = (_contiguous(x) for x in inputs)
        b, w = (beta, beta) if beta is not None else (erase, write)
        self.operand_names = ("q", "k", "v", "g", "gk", "beta" if beta is not None else "erase",
                              "beta" if beta is not None else "write", "A_log", "dt_bias")
        # per call, the kernel checks a slab's bytes against the inputs' (in its order; contiguous:
        # numel * size each)
        self.check_slab = per_call_checks and p.in_place
        slab_bytes, operand_bytes = 0, (0,) * 9
        if self.check_slab:
            slab_bytes = aliasing.byte_range(p.initial_state)[1] - p.initial_state.data_ptr()
            operand_bytes = tuple(0 if x is None else x.numel() * x.element_size()
                                  for x in (q, k, v, g, gk, b, w, a_log, dt_bias))
        # a slab row is read back by the next step: only a fresh state that outgrows the cache streams
        state_bytes = 2 * p.N * p.Hv * p.K * p.V * p.state_dtype.itemsize
        q = q.view(p.B, p.T, p.Hq // p.G, p.G, p.K)
        S0 = p.initial_state
        if S0 is not None and p.state_layout == "vk":
            S0 = S0.transpose(-1, -2)                    # a strided [*, Hv, K, V] view, no copy
        S, o = self._outputs(S0)
        self.recurrence = cpu_recurrent.Recurrence(
            q, k, v, g, gk, b, w, a_log, dt_bias, S0, S.transpose(-1, -2) if p.state_layout == "vk" and
            not p.in_place else S, o.view(p.B, p.T, p.Hv, p.G, p.V), *_tables(p), scale=p.scale,
            l2norm_eps=p.l2norm_eps if p.qk_l2norm else None, raw_gate=p.A_log is not None,
            gate_sigmoid=p.beta_sigmoid, stream_state=not p.in_place and state_bytes > LAST_LEVEL_CACHE_BYTES,
            prefetch_next=state_bytes > 2 * L2_BYTES,
            check_decay=per_call_checks and p.decays and p.A_log is None and not p.accept_growth,
            slab_bytes=slab_bytes, operand_bytes=operand_bytes, capture=p.capture, capacity=p.capacity)

    def _outputs(self, S0):
        """(S, o): the states the kernel writes (the slab itself, or a fresh state in the call's
        layout) and a fresh o."""
        o = _empty(self.o_shape, self.o_dtype, zero=self.zero_o)
        return (S0 if self.in_place else _empty(self.state_shape, self.state_dtype)), o

    def __call__(self, q, k, v, g, gk, beta, erase, write, A_log, dt_bias, initial_state):
        """(o [B, T, Ho, V], state): runs the kernel on tensors of the signature this launch was
        made for. Raises ContractError for a positive log decay or, with a slab, an input that
        shares its memory (before any work). Kept lean: a decode step calls it per layer."""
        if self.copy:                                # (rare) inputs copied: their own ranges checked first
            inputs = (q, k, v, g, gk, beta, erase, write, A_log, dt_bias)
            if self.check_slab:
                aliasing.check_written("initial_state", initial_state, zip(_INPUT_NAMES, inputs))
            q, k, v, g, gk, beta, erase, write, A_log, dt_bias = (_contiguous(x) for x in inputs)
        if self.small_o:                             # (decode: torch's allocator, uninitialised)
            o = torch.empty(self.o_shape, dtype=self.o_dtype)
        else:
            o = _empty(self.o_shape, self.o_dtype, zero=self.zero_o)
        S = initial_state if self.in_place else _empty(self.state_shape, self.state_dtype)
        result = self.recurrence.run(_pointers(q, k, v, g, gk, beta, erase, write, A_log, dt_bias, initial_state,
                                               S, o), min(torch.get_num_threads(), self.threads))
        if result != cpu_recurrent.OK:
            raise self._refusal(result, g, gk)
        return o, S

    def run_into(self, o, q, k, v, g, gk, beta, erase, write, A_log, dt_bias, initial_state) -> None:
        """`__call__` for a launch that updates a slab in place, writing o into the caller's
        `o` (contiguous, of the launch's o shape and dtype: a serving engine's output buffer,
        no allocation and no copy) instead of a fresh tensor. The inputs as `__call__`'s.
        Raises as `__call__`."""
        if self.copy:                                # (strided gates) copied: their own ranges checked first
            inputs = (q, k, v, g, gk, beta, erase, write, A_log, dt_bias)
            if self.check_slab:
                aliasing.check_written("initial_state", initial_state, zip(_INPUT_NAMES, inputs))
            q, k, v, g, gk, beta, erase, write, A_log, dt_bias = (_contiguous(x) for x in inputs)
        if self.zero_o:                              # tokens no sequence owns: zeros, as a fresh o
            o.zero_()
        result = self.recurrence.run(_pointers(q, k, v, g, gk, beta, erase, write, A_log, dt_bias, initial_state,
                                               initial_state, o), min(torch.get_num_threads(), self.threads))
        if result != cpu_recurrent.OK:
            raise self._refusal(result, g, gk)

    def kernel(self, q, k, v, g, gk, beta, erase, write, A_log, dt_bias, initial_state):
        """The kernel alone on these contiguous tensors, as a no-argument callable returning the
        kernel's result code: the outputs allocated once, no Python between calls but the
        packing of the operands' addresses. `deltarule bench` times it for the call's overhead
        (a call's time minus this)."""
        S, o = self._outputs(initial_state)
        pointers = _pointers(q, k, v, g, gk, beta, erase, write, A_log, dt_bias, initial_state, S, o)

        def run(_keep=(o, S)):                       # the outputs live as long as the callable
            return self.recurrence.run(pointers, min(torch.get_num_threads(), self.threads))
        return run

    def _refusal(self, result: int, g, gk):
        """The ContractError of a kernel refusal (before any work)."""
        if result == cpu_recurrent.SHARED:
            return aliasing.shared("initial_state", self.operand_names[self.recurrence.bad])
        name, x = ("g", g) if result == cpu_recurrent.POSITIVE_G else ("gk", gk)
        return positive_log_decay(name, x, self.recurrence.bad)


_INPUT_NAMES = ("q", "k", "v", "g", "gk", "beta", "erase", "write", "A_log", "dt_bias")


def _pointers(q, k, v, g, gk, beta, erase, write, A_log, dt_bias, initial_state, S, o) -> tuple[int, ...]:
    """The kernel's operand addresses (`cpu_recurrent.operands`; beta stands for both erase and write)."""
    b, w = (beta, beta) if beta is not None else (erase, write)
    return cpu_recurrent.operands(q, k, v, g, gk, b, w, A_log, dt_bias, initial_state, S, o)


def _contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.contiguous()


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
    backward.c. Those two are outputs too (not differentiable), so that the Function has
    torch.func's form (a forward without ctx, `setup_context`): the compiled backward op
    (`deltarule.custom_ops`) differentiates a call with `torch.func.vjp`."""

    @staticmethod
    def forward(p, q, k, v, g, gk, b, w, S0):
        spans, first, starts, finals = _checkpoint_tables(p)
        ck = _empty((int(first[-1]), p.Hv, p.K, p.V), torch.float32, pool_from=GRAD_POOL_MIN_BYTES)
        ck[starts] = 0.0 if S0 is None else S0
        o = _empty((p.B, p.T, p.Hv, p.G, p.V), torch.float32, zero=not p.plan.covered(),
                   pool_from=GRAD_POOL_MIN_BYTES)
        u = _empty((p.B, p.T, p.Hv, p.V), torch.float32, pool_from=GRAD_POOL_MIN_BYTES)
        _, _, owner = _tables(p)
        cpu_recurrent.Recurrence(q, k, v, g, gk, b, w, None, None, ck, ck, o, spans, None, owner, scale=p.scale,
                                 l2norm_eps=None, u_out=u, checkpoint=CHECKPOINT).run_packed(_threads(p, p.plan.steps))
        S = ck.index_select(0, finals)
        return o, S, u, ck

    @staticmethod
    def setup_context(ctx, inputs, output):
        p, q, k, v, g, gk, b, w, _ = inputs
        _, _, u, ck = output
        ctx.mark_non_differentiable(u, ck)
        ctx.p = p
        ctx.save_for_backward(q, k, v, u, g, gk, b, w, ck)

    @staticmethod
    def backward(ctx, do, dS, _du, _dck):
        p = ctx.p
        q, k, v, u, g, gk, b, w, ck = ctx.saved_tensors
        need = ctx.needs_input_grad[1:]
        do = torch.zeros(p.B, p.T, p.Hv, p.G, p.V) if do is None else do.float().contiguous()
        dS = None if dS is None else dS.float().contiguous()
        dq, dk, dv, dlam, db, dw, dS0 = (
            None if absent else x for x, absent in zip(
                _native_backward(q, k, v, u, g, gk, b, w, ck, dS, do, _backward_spans(p), p.scale, p.N,
                                 not p.plan.covered(), need[0], need[7], _threads(p, 4 * p.plan.steps)),
                (not need[0], False, False, g is None and gk is None, b is None, w is None, not need[7])))
        dq, dk = _grad.head_sums(p, dq, dk)
        dg = None if g is None else (dlam if gk is None else dlam.sum(-1))
        grads = (dq, dk, dv, dg, dlam if gk is not None else None, db, dw, dS0)
        return (None, *(x if n else None for x, n in zip(grads, need)))


@torch.library.custom_op("deltarule::cpu_backward", mutates_args=())
def _native_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, u: torch.Tensor, g: Optional[torch.Tensor],
                     gk: Optional[torch.Tensor], b: Optional[torch.Tensor], w: Optional[torch.Tensor],
                     ck: torch.Tensor, dS: Optional[torch.Tensor], do: torch.Tensor, spans: torch.Tensor,
                     scale: float, num_states: int, zero: bool, need_dq: bool, need_dS0: bool,
                     threads: int) -> list[torch.Tensor]:
    """The native reverse kernel (`cpu_recurrent.backward`) as an op: [dq, dk, dv, dlam, db, dw,
    dS0], an empty tensor for each one the call has no use for (no decay, no gate, not needed).
    An op because `_Recurrence.backward` runs under `torch.func.vjp` in the compiled backward
    (`deltarule.custom_ops`), where its tensors are torch.func's wrappers without storage: an
    op's implementation receives the plain tensors. Shapes as `_Recurrence`'s operands: q
    [B, T, Hq/G, G, K] (dq per state head [B, T, Hv, G, K]), u [B, T, Hv, V], ck the
    checkpoints, do [B, T, Hv, G, V], dS None | [N, Hv, K, V], spans `_backward_spans`."""
    B, T, Hv, V = v.shape
    K, G = k.shape[3], q.shape[3]
    out = lambda *shape: _empty(shape, torch.float32, zero=zero, pool_from=GRAD_POOL_MIN_BYTES)  # noqa: E731
    gate = lambda x, channels: None if x is None else out(B, T, Hv, *channels[:x.dim() - 3])  # noqa: E731
    dq = out(B, T, Hv, G, K) if need_dq else None
    dk, dv = out(B, T, Hv, K), out(B, T, Hv, V)
    dlam = None if g is None and gk is None else out(B, T, Hv, *((K,) if gk is not None else ()))
    db, dw = gate(b, (K,)), gate(w, (V,))
    dS0 = torch.empty(num_states, Hv, K, V) if need_dS0 else None
    cpu_recurrent.backward(q, k, v, u, g, gk, b, w, ck, dS, do, spans, dq, dk, dv, dlam, db, dw, dS0, scale=scale,
                           chunk=CHECKPOINT, threads=threads)
    return [q.new_empty(0) if x is None else x for x in (dq, dk, dv, dlam, db, dw, dS0)]


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
