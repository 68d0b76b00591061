"""The fused gate of the Gated DeltaNet family: decay and update rate from raw projections.

    decay = decay_scale * softplus(a + dt_bias)
    beta  = sigmoid(b)

The arithmetic is float32 whatever the input dtype, and the results are
narrowed to `a`'s dtype only on store: `exp(decay)` inside the recurrence
amplifies any precision lost here. For Gated DeltaNet, `decay_scale` is
`-exp(A_log)`, so `decay` is the log-space decay `g` that
`deltarule.linear_attention` takes (the same value as its raw-gate arm,
`A_log` / `dt_bias`, forms internally).

`bounded_gate` is KDA's bounded per-key decay (fla's ``lower_bound`` gate),

    gk = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))

which `linear_attention`'s raw-gate arm does not form: the fla drop-ins and the
vLLM plugin's Kimi Linear layers pass its result as `gk`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import ContractError
from .validation import finite_float32

__all__ = ["gate", "bounded_gate"]

_GATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gate(
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    decay_scale: torch.Tensor,
    b: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """decay = decay_scale * softplus(a + dt_bias); beta = sigmoid(b), in float32.

    Args:
        a: [..., H] raw decay projection, rank >= 1, float32 / float16 /
            bfloat16; the last axis is the head axis, the leading axes are
            folded (any of them may be empty).
        dt_bias: [H] float32 per-head bias added to `a`.
        decay_scale: [H] float32 per-head multiplier of the softplus
            (`-exp(A_log)` for Gated DeltaNet).
        b: optional raw update-rate projection, `a`'s shape and dtype.

    Returns:
        (decay, beta): `decay` with `a`'s shape and dtype; `beta` with `b`'s
        shape and dtype, or None when `b` is None.

    Raises:
        ContractError: a wrong type, rank, shape, dtype or device, before any work.

    Example:
        >>> import torch, deltarule
        >>> a = torch.zeros(2, 3)
        >>> decay, beta = deltarule.gate(a, torch.zeros(3), -torch.ones(3), b=torch.zeros(2, 3))
        >>> round(decay[0, 0].item(), 6), beta[0, 0].item()
        (-0.693147, 0.5)
    """
    if not isinstance(a, torch.Tensor):
        raise ContractError("a", "a torch.Tensor", type(a).__name__)
    if a.dim() < 1:
        raise ContractError("a", "a tensor of rank >= 1 ([..., H])", f"shape {list(a.shape)}")
    if a.dtype not in _GATE_DTYPES:
        raise ContractError("a", "dtype float32, float16 or bfloat16", a.dtype)
    H = a.shape[-1]
    if H < 1:
        raise ContractError("a", "a head axis (last) of extent >= 1", f"shape {list(a.shape)}")
    for name, x in (("dt_bias", dt_bias), ("decay_scale", decay_scale)):
        if not isinstance(x, torch.Tensor):
            raise ContractError(name, "a torch.Tensor", type(x).__name__)
        if tuple(x.shape) != (H,):
            raise ContractError(name, f"shape [{H}] (a's head axis)", list(x.shape))
        if x.dtype != torch.float32:
            raise ContractError(name, "dtype float32", x.dtype)
        if x.device != a.device:
            raise ContractError(name, f"device {a.device} (a's)", x.device)
    if b is not None:
        if not isinstance(b, torch.Tensor):
            raise ContractError("b", "a torch.Tensor or None", type(b).__name__)
        if tuple(b.shape) != tuple(a.shape):
            raise ContractError("b", f"a's shape {list(a.shape)}", list(b.shape))
        if b.dtype != a.dtype:
            raise ContractError("b", f"a's dtype {a.dtype}", b.dtype)
        if b.device != a.device:
            raise ContractError("b", f"device {a.device} (a's)", b.device)

    f32 = torch.float32
    decay = (decay_scale * F.softplus(a.to(f32) + dt_bias)).to(a.dtype)
    beta = None if b is None else torch.sigmoid(b.to(f32)).to(b.dtype)
    return decay, beta


def bounded_gate(
    g: torch.Tensor,
    lower_bound: float,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """KDA's bounded per-key decay: lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), in float32.

    The log-space decay of each key channel lies in (lower_bound, 0) for a negative
    `lower_bound` (fla's ``lower_bound`` gate of ``chunk_kda`` / ``fused_recurrent_kda``).

    Args:
        g: [..., H, K] raw per-key gate, rank >= 2, any floating-point dtype; the leading
            axes are folded (any of them may be empty).
        lower_bound: the bound, a real number finite in float32 (negative for a decay), or
            a one-element real tensor.
        A_log: optional [H] (or any shape of H elements) per-head log scale, floating-point,
            on g's device; None: a scale of 1, lower_bound * sigmoid(g + dt_bias).
        dt_bias: optional [H, K] (or [H * K]) per-key bias added to `g`, floating-point, on
            g's device; None: 0.

    Returns:
        gk: [..., H, K] float32 (`g`'s shape), `linear_attention`'s per-key ``gk``.

    Raises:
        ContractError: `g` not a floating-point tensor of rank >= 2, `A_log` / `dt_bias` of
            another element count, dtype or device, or `lower_bound` not a real number finite
            in float32, before any work.

    Example:
        >>> import torch
        >>> from deltarule.gate import bounded_gate
        >>> gk = bounded_gate(torch.zeros(1, 5, 2, 4), -5.0, A_log=torch.zeros(2))
        >>> gk.shape, gk.dtype, gk[0, 0, 0, 0].item()
        (torch.Size([1, 5, 2, 4]), torch.float32, -2.5)
    """
    bound = _check_bounded(g, lower_bound, A_log, dt_bias)
    H, K = g.shape[-2], g.shape[-1]
    x = g.to(torch.float32)
    if dt_bias is not None:
        x = x + dt_bias.reshape(H, K).to(torch.float32)
    if A_log is not None:
        x = torch.exp(A_log.reshape(H).to(torch.float32))[:, None] * x
    return bound * torch.sigmoid(x)


def _check_bounded(g, lower_bound, A_log, dt_bias) -> float:
    """`bounded_gate`'s argument checks, every one before any work: lower_bound as a float, or
    ContractError."""
    if not isinstance(g, torch.Tensor):
        raise ContractError("g", "a torch.Tensor", type(g).__name__)
    if g.dim() < 2:
        raise ContractError("g", "a tensor of rank >= 2 ([..., H, K])", f"shape {list(g.shape)}")
    if not g.dtype.is_floating_point:            # .to(float32) would drop an imaginary part silently
        raise ContractError("g", "a floating-point dtype", g.dtype)
    H, K = g.shape[-2], g.shape[-1]
    for name, x, count, layout in (("A_log", A_log, H, "[H]"), ("dt_bias", dt_bias, H * K, "[H, K] or [H * K]")):
        if x is not None and (not isinstance(x, torch.Tensor) or x.numel() != count):
            raise ContractError(name, f"None or a tensor of {count} elements ({layout}; g is [..., H, K])",
                                getattr(x, "shape", type(x).__name__))
        if x is not None and not x.dtype.is_floating_point:
            raise ContractError(name, "a floating-point dtype", x.dtype)
        if x is not None and x.device != g.device:
            raise ContractError(name, f"device {g.device} (g's)", x.device)
    return check_lower_bound(lower_bound)


def check_lower_bound(lower_bound) -> float:
    """`bounded_gate`'s lower_bound (also the fla drop-ins' safe_gate range check) as a Python
    float: a real number (a 0-d NumPy array, a one-element real tensor) finite in float32, the
    gate's precision (-1e39 would be a -inf decay, NaN a NaN one), or ContractError."""
    value = lower_bound
    if isinstance(lower_bound, torch.Tensor):
        if lower_bound.numel() != 1 or lower_bound.dtype == torch.bool or lower_bound.is_complex():
            raise ContractError("lower_bound", "a real number (or a one-element real tensor)",
                                f"a {lower_bound.dtype} tensor of shape {list(lower_bound.shape)}")
        if lower_bound.requires_grad and torch.is_grad_enabled():     # read as a number: no gradient flows
            raise ContractError("lower_bound", "a number or a tensor that does not require grad (the bound is "
                                "read as a constant)", "requires_grad=True")
        value = lower_bound.item()
    elif getattr(lower_bound, "ndim", None) == 0 and hasattr(lower_bound, "item"):     # a 0-d NumPy array
        value = lower_bound.item()
    if not finite_float32(value):
        raise ContractError("lower_bound", "a real number finite in float32 (negative for a decay)",
                            repr(lower_bound))
    return float(value)
