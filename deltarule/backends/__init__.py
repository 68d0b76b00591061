"""Backend registry and `backend="auto"` dispatch.

A backend module has NAME, DESCRIPTION, SUPPORTS (feature -> what it covers),
unavailable() -> None or why it cannot run on this machine and what to install
(available() -> bool is `unavailable() is None`),
supports(problem) -> None or the reason it declines, and run(problem).
"""

from __future__ import annotations

from ..errors import ContractError, Unsupported
from ..problem import DeviceSlab, Problem
from . import cpu_backend, reference_backend, torch_backend, triton_backend, wgsl_backend

# Fastest first: "auto" takes the first available backend that accepts the call
# (cpu declines non-CPU tensors, so CUDA tensors reach triton first; CPU tensors
# never reach the Triton interpreter while cpu is available). wgsl is not in the order:
# its inputs are torch tensors copied to the WebGPU device on every call, so it
# is never the fastest choice for them; a device-resident slab routes to it.
REGISTRY = {m.NAME: m for m in (cpu_backend, triton_backend, torch_backend, reference_backend, wgsl_backend)}
AUTO_ORDER = ("cpu", "triton", "torch", "reference")


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def info() -> list[dict]:
    """One entry per backend: name, description, availability here (and "unavailable": why
    not, None when available), what it supports."""
    entries = []
    for m in REGISTRY.values():
        reason = m.unavailable()
        entries.append({"name": m.NAME, "description": m.DESCRIPTION, "available": reason is None,
                        "unavailable": reason, "supports": m.SUPPORTS})
    return entries


def _declines(m, p: Problem) -> str | None:
    """None when backend module m takes the call here, else why not (unavailable: why, and
    what to install)."""
    reason = m.unavailable()
    if reason is not None:
        return f"not available on this machine: {reason}"
    return m.supports(p)


def launch(p: Problem, backend: str):
    """A launch of the validated call `p` that its call signature can reuse (`cpu_backend.Launch`:
    the cpu backend's, with the per-call checks), or None where the backend `dispatch` would
    pick keeps none: only the cpu backend does, for calls without gradients."""
    if backend not in ("auto", "cpu") or p.requires_grad or isinstance(p.initial_state, DeviceSlab):
        return None
    if _declines(cpu_backend, p) is not None:
        return None
    return cpu_backend.Launch(p, per_call_checks=True)


def dispatch(p: Problem, backend: str):
    device_slab = isinstance(p.initial_state, DeviceSlab)
    if device_slab and isinstance(backend, str) and backend in REGISTRY and backend != p.initial_state.backend:
        raise Unsupported(f"backend {backend!r} declines this call: the state slab lives on "
                          f"the {p.initial_state.backend!r} backend's device")
    if isinstance(backend, str) and backend == "auto":
        reasons = []
        for name in (p.initial_state.backend,) if device_slab else AUTO_ORDER:
            m = REGISTRY[name]
            reason = _declines(m, p)
            if reason is None:
                try:
                    return m.run(p)
                except Unsupported as e:
                    reason = str(e)
            reasons.append(f"{name}: {reason}")
        raise Unsupported("no backend accepts this call: " + "; ".join(reasons))
    if not isinstance(backend, str) or backend not in REGISTRY:
        raise ContractError("backend", "'auto' or one of " + ", ".join(map(repr, REGISTRY)), repr(backend))
    m = REGISTRY[backend]
    reason = _declines(m, p)
    if reason is not None:
        raise Unsupported(f"backend {backend!r} declines this call: {reason}")
    return m.run(p)
