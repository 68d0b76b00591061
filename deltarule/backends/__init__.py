"""Backend registry and `backend="auto"` dispatch.

A backend module has NAME, DESCRIPTION, SUPPORTS (feature -> what it covers),
unavailable() -> None or why it cannot run on this machine and what to install
(available() -> bool is `unavailable() is None`),
supports(problem) -> None or the reason it declines, and run(problem); optionally
launch(problem) -> a launch its call signature reuses, or None (`launch`).
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
    """A launch of the validated call `p` that its call signature can reuse, or None: the
    optional part of the backend protocol, ``launch(problem) -> callable | None`` (the
    callable takes the call's tensors in `arguments.LAUNCH_OPERANDS` order and returns
    (o, state), checking on every call what validation reads from their values and
    addresses). Asked of the backend `dispatch` would pick; only the cpu backend keeps
    launches (`cpu_backend.Launch`), for calls without gradients."""
    if isinstance(p.initial_state, DeviceSlab):
        return None
    if backend == "auto":
        m = next((REGISTRY[name] for name in AUTO_ORDER if _declines(REGISTRY[name], p) is None), None)
    else:
        m = REGISTRY.get(backend) if isinstance(backend, str) else None
        if m is not None and _declines(m, p) is not None:
            return None                                  # dispatch says why, on every call
    keeps = getattr(m, "launch", None)
    return None if keeps is None else keeps(p)


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
