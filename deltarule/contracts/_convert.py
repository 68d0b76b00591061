"""NumPy / torch in and out for the runtime adapters.

An adapter call takes NumPy arrays or torch tensors and answers in the kind of
its first input (`query`, or `a` for the gate): NumPy in, NumPy out; torch in,
torch out, on the first input's device. The other inputs may be either kind;
NumPy ones are moved to that device. NumPy bfloat16 (the `ml_dtypes` dtype
that onnx and onnxruntime use) round-trips through torch.bfloat16.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ContractError

_NUMPY_DTYPES = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
}

DTYPE_NAMES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.float64: "float64", torch.int32: "int32", torch.int64: "int64",
}


class Kind:
    """How the caller spoke: NumPy or torch, and on which torch device."""

    def __init__(self, name: str, first):
        if isinstance(first, torch.Tensor):
            self.numpy, self.device = False, first.device
        elif isinstance(first, np.ndarray):
            self.numpy, self.device = True, torch.device("cpu")
        else:
            raise ContractError(name, "a numpy.ndarray or a torch.Tensor", type(first).__name__)

    def tensor(self, name: str, x, *, optional: bool = True) -> torch.Tensor | None:
        """`x` as a torch tensor (None stays None when optional)."""
        if x is None:
            if optional:
                return None
            raise ContractError(name, "a numpy.ndarray or a torch.Tensor", None)
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, np.ndarray):
            return _from_numpy(name, x).to(self.device)
        raise ContractError(name, "a numpy.ndarray, a torch.Tensor or None" if optional
                            else "a numpy.ndarray or a torch.Tensor", type(x).__name__)

    def out(self, x: torch.Tensor | None):
        """A result in the caller's kind."""
        if x is None or not self.numpy:
            return x
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            import ml_dtypes  # present whenever a NumPy bfloat16 input was

            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()


def _from_numpy(name: str, x: np.ndarray) -> torch.Tensor:
    if x.dtype.name == "bfloat16":                 # ml_dtypes.bfloat16
        bits = np.ascontiguousarray(x).view(np.int16)
        return torch.from_numpy(bits.copy()).view(torch.bfloat16)
    dtype = _NUMPY_DTYPES.get(x.dtype)
    if dtype is None:
        raise ContractError(name, "a float32, float16, bfloat16 or int32 / int64 array", f"dtype {x.dtype}")
    if not x.flags.writeable or not x.flags.c_contiguous:
        x = np.array(x, copy=True, order="C")
    return torch.from_numpy(x)


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype))
