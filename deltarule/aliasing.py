"""The aliasing rule (docs/design.md, "Aliasing"): a tensor a call writes may not overlap itself or
any input the call reads.

A slab call (`state_indices`) writes `initial_state` in place after reading q, k, v and the gates:
a slab whose rows share memory (an `expand`ed or `as_strided` one) or an input that is a view of
the slab would be read after it was written (a silently wrong answer), so both are refused before
any work. Inputs that are only read may share memory with each other.

Both tests are conservative and cost O(rank) per tensor (no element is read):

- a tensor overlaps itself unless, its dimensions of size > 1 sorted by stride, each stride
  exceeds the farthest offset the smaller ones reach (every layout that slicing, `transpose`,
  `permute` and `view` make of non-overlapping memory passes; a stride 0 fails);
- two tensors overlap when the byte ranges between their first and last elements intersect
  (separate allocations never do; interleaved views of one buffer are refused even where their
  elements happen to miss each other).
"""

from __future__ import annotations

import torch

from .errors import ContractError


def byte_range(x: torch.Tensor) -> tuple[int, int]:
    """[first, end) addresses of x's elements; (0, 0) for an empty tensor."""
    last = 0
    for n, s in zip(x.shape, x.stride()):
        if n == 0:
            return 0, 0
        last += (n - 1) * s
    start = x.data_ptr()
    return start, start + (last + 1) * x.element_size()


def overlaps_itself(x: torch.Tensor) -> bool:
    """Two indices of x may address one element (see the module docstring)."""
    reach = 0
    for stride, size in sorted((s, n) for n, s in zip(x.shape, x.stride()) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def check_written(name: str, x: torch.Tensor, reads) -> None:
    """Refuse a tensor `name` that the call writes after reading `reads` ((name, tensor or None)
    pairs) when it overlaps itself or one of them (ContractError naming `name`)."""
    if x.device.type == "meta":                      # no memory: nothing can alias
        return
    if overlaps_itself(x):
        raise ContractError(name, "a tensor whose elements do not share memory (it is written in place)",
                            f"strides {tuple(x.stride())} for shape {tuple(x.shape)} overlap")
    x0, x1 = byte_range(x)
    if x0 == x1:
        return
    for other, y in reads:
        if y is None:
            continue
        y0, y1 = byte_range(y)
        if x0 < y1 and y0 < x1 and y0 != y1:
            raise shared(name, other)


def shared(name: str, other: str) -> ContractError:
    """The error of a tensor `name` written in place that shares memory with the input `other`."""
    return ContractError(name, "memory that no input shares (it is written in place after the inputs are read)",
                         f"{other} shares its memory")
