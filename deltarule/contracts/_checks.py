"""Argument checks shared by the slab-based adapters (`contracts.slab`, `contracts.ascend`).

Each raises `deltarule.ContractError` naming the operator's argument; `state_tensor` and
`write_back` give a NumPy state the in-place semantics of a torch one.
"""

from __future__ import annotations

import numpy as np
import torch

from ..api import finite_float32
from ..errors import ContractError
from ._convert import Kind, dtype_name


def names(dtypes) -> str:
    return " or ".join(dtype_name(t) for t in dtypes)


def float32_or(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    return (torch.float32,) if dtype == torch.float32 else (torch.float32, dtype)


def check_tensor(name, x, *, shape, letters, dtypes, device):
    """`x` has `shape` (spelled `letters` in the error), one of `dtypes`, and lives on `device`."""
    if tuple(x.shape) != tuple(shape):
        raise ContractError(name, f"shape {letters} = {list(shape)}", f"shape {list(x.shape)}")
    if x.dtype not in dtypes:
        raise ContractError(name, "dtype " + names(dtypes), dtype_name(x.dtype))
    if x.device != device:
        raise ContractError(name, f"device {device} (query's)", x.device)


def check_floating(name, x, *, device) -> None:
    """`x` a real floating-point tensor on `device`: one the adapter converts to float32 itself,
    where a complex one would lose its imaginary part and an int or bool one pass silently."""
    if not x.is_floating_point():
        raise ContractError(name, "a floating-point dtype", dtype_name(x.dtype))
    if x.device != device:
        raise ContractError(name, f"device {device}", x.device)


def host_ints(name, x, *, length, letters, device) -> list[int]:
    """An int32 index vector of `length` entries on `device`, read to the host."""
    check_tensor(name, x, shape=(length,), letters=letters, dtypes=(torch.int32,), device=device)
    return x.tolist()


def check_rows(name, rows, num_slots, *, why) -> None:
    """Every row in [0, num_slots) and no row twice (one store per slab row per call; `why`
    says whose rule that is)."""
    seen = {}
    for i, r in enumerate(rows):
        if not 0 <= r < num_slots:
            raise ContractError(name, f"slab rows in [0, {num_slots})", f"{name}[{i}] = {r}")
        if r in seen:
            raise ContractError(name, f"distinct slab rows ({why})",
                                f"row {r} at {name}[{seen[r]}] and {name}[{i}]")
        seen[r] = i


def check_scale(name, scale) -> float | None:
    """A finite real scale, or None (deltarule's default, K ** -0.5)."""
    if scale is None:
        return None
    if not finite_float32(scale):
        raise ContractError(name, "a float finite in float32 (the kernels' precision) or None", repr(scale))
    return float(scale)


def state_tensor(kind: Kind, name, x) -> torch.Tensor:
    """The state a call updates in place, as a torch tensor; a NumPy one must be writeable
    (the results are written back into it, `write_back`)."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ContractError(name, "a writeable array (the state is updated in place)", "a read-only array")
    s = kind.tensor(name, x, optional=False)
    if s.dim() != 4:
        raise ContractError(name, "a rank-4 state slab", f"shape {list(s.shape)}")
    return s


def write_back(x, s: torch.Tensor, rows) -> None:
    """A NumPy state in: copy the slab rows the call wrote from the torch slab `s` into the
    caller's array, unless `s` shares its memory (then they are there already)."""
    if not isinstance(x, np.ndarray):
        return
    result = Kind("state", x).out(s)
    if not np.shares_memory(result, x):
        rows = sorted(set(rows))
        x[rows] = result[rows]
