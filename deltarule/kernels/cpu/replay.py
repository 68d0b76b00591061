"""ctypes binding of the native replay (csrc/replay.c): captured transitions applied to slab
rows in place. Compute only: `deltarule.replay` validates and chooses it (CPU tensors, a
contiguous state); its torch twin is `deltarule.replay._advance`."""

import torch

from .recurrent import _LIB, TYPES


def available() -> bool:
    return _LIB is not None


def replay(state: torch.Tensor, vk: bool, capture: torch.Tensor, rows: list[int], counts: list[int], *,
           C: int, Hk: int, K: int, V: int, Dw: int) -> None:
    """Row rows[n] of `state` (contiguous [S, Hv, K, V], or [S, Hv, V, K] with `vk`; float32 /
    float16 / bfloat16) advanced by the first counts[n] transitions of capture row n
    (contiguous float32 [N, C * (Dw + Hk*K + Hv*V)]); rows < 0 and counts of 0 skipped."""
    index = torch.tensor(rows, dtype=torch.int64)
    steps = torch.tensor(counts, dtype=torch.int64)
    failed = _LIB.deltarule_replay(state.data_ptr(), TYPES[state.dtype], int(vk), capture.data_ptr(),
                                   index.data_ptr(), steps.data_ptr(), len(rows), C, state.shape[1], Hk, K, V, Dw)
    if failed:
        raise MemoryError("deltarule replay: no memory for a state row")
