"""The argument checks `causal_conv1d_slab` and `causal_conv1d_with_state` share: the
activations, the dtypes they take, a tensor argument's rank, dtype, device and shape."""

from __future__ import annotations

import torch

from ..errors import ContractError

ACTIVATIONS = (None, "silu")
STATE_TYPES = (torch.float32, torch.bfloat16, torch.float16)
INPUT_TYPES = STATE_TYPES            # x, weight, bias: the arithmetic is float32 (float64: reference_conv1d_slab)


def check_tensor(name, t, rank, dtypes, shape, device=None, exact=None):
    """A tensor argument of `rank`, one of `dtypes`, on `device`, of shape `exact` where given
    (`shape`: the expected shape in words), or ContractError."""
    if not isinstance(t, torch.Tensor):
        raise ContractError(name, "a torch.Tensor", type(t).__name__)
    if t.dim() != rank or (exact is not None and tuple(t.shape) != exact):
        raise ContractError(name, shape, tuple(t.shape))
    if t.dtype not in dtypes:
        raise ContractError(name, "dtype " + " / ".join(str(d) for d in dtypes), t.dtype)
    if device is not None and t.device != device:
        raise ContractError(name, f"device {device} (x's)", t.device)
