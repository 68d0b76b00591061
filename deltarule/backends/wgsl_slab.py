"""`WgslStateSlab` (`deltarule.WgslStateSlab`): recurrent states that stay in GPU memory between
calls, the `wgsl` backend's device slab."""

from __future__ import annotations

import torch

from ..kernels.wgsl import _device
from ..problem import LAYOUTS, DeviceSlab


class WgslStateSlab(DeviceSlab):
    """A float32 state slab in a WebGPU buffer, updated in place by the `wgsl` backend.

    Pass it as `initial_state` with `state_indices` to `deltarule.linear_attention`
    (backend "wgsl" or "auto"): sequence n reads and writes row
    `state_indices[n]` on the device, so decode never copies the state to or
    from the host; the call returns `(o, slab)` with `o` a torch tensor.

    Args:
        num_slots: S, the number of rows.
        Hv, K, V: state heads, key and value sizes.
        layout: "kv" (default): rows [Hv, K, V]; "vk": rows [Hv, V, K].

    Attributes:
        shape: (S, Hv, K, V) or (S, Hv, V, K); `layout`; `backend` == "wgsl";
        `buffer`, the wgpu buffer. A new slab is all zeros.

    Example:
        >>> import torch, deltarule
        >>> from deltarule import WgslStateSlab
        >>> B, H, K, V = 2, 2, 8, 8
        >>> slab = WgslStateSlab(4, H, K, V)
        >>> slab.upload(torch.ones(4, H, K, V))
        >>> q, k, v = (torch.randn(B, 1, H, d) for d in (K, K, V))
        >>> k = torch.nn.functional.normalize(k, dim=-1)
        >>> g, beta = -torch.rand(B, 1, H), torch.rand(B, 1, H)
        >>> o, state = deltarule.linear_attention(q, k, v, g=g, beta=beta, initial_state=slab,
        ...                                       state_indices=torch.tensor([3, 1]), backend="wgsl")
        >>> state is slab, tuple(o.shape)
        (True, (2, 1, 2, 8))
        >>> rows = slab.download()
        >>> bool((rows[0] == 1).all()), bool((rows[3] == 1).all())
        (True, False)
    """

    backend = "wgsl"

    def __init__(self, num_slots: int, Hv: int, K: int, V: int, layout: str = "kv"):
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        self.layout = layout
        self.shape = (num_slots, Hv, K, V) if layout == "kv" else (num_slots, Hv, V, K)
        self.buffer = _device.zeros(self.nbytes)

    @property
    def nbytes(self) -> int:
        S, H, X, Y = self.shape
        return S * H * X * Y * 4

    @classmethod
    def from_tensor(cls, state: torch.Tensor, layout: str = "kv") -> WgslStateSlab:
        """A slab holding a copy of `state` (float32 [S, Hv, K, V], or [S, Hv, V, K] for "vk")."""
        S, H, X, Y = state.shape
        slab = cls(S, H, *((X, Y) if layout == "kv" else (Y, X)), layout=layout)
        slab.upload(state)
        return slab

    def upload(self, state: torch.Tensor) -> None:
        """Overwrite every row with `state` (float32, the slab's shape), host -> device."""
        if state.dtype != torch.float32 or tuple(state.shape) != self.shape:
            raise ValueError(f"state: expected float32 {list(self.shape)}, got {state.dtype} {list(state.shape)}")
        _device.write(self.buffer, state)

    def download(self) -> torch.Tensor:
        """A host copy of every row: float32 tensor of the slab's shape."""
        raw = bytearray(_device.download(self.buffer, self.nbytes))
        return torch.frombuffer(raw, dtype=torch.float32).view(self.shape)
