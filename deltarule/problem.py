"""A validated call: what the API hands to every backend.

`Problem` holds the caller's tensors untouched plus the facts the validation
derived (sizes, the host-side sequence spans, the slab slots). Backends read it
and never re-validate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RULES = ("linear", "gated", "delta", "gated_delta")
GATED_RULES = ("gated", "gated_delta")
DELTA_RULES = ("delta", "gated_delta")
LAYOUTS = ("kv", "vk")
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class DeviceSlab:
    """A state slab that lives in an accelerator's memory outside torch.

    Accepted as `initial_state` together with `state_indices`; only the backend
    named by `backend` runs on it. Subclasses set `backend`, `layout` ("kv" or
    "vk") and `shape`: (S, Hv, K, V) for "kv", (S, Hv, V, K) for "vk".
    """

    backend: str
    layout: str
    shape: tuple[int, int, int, int]


@dataclass(frozen=True)
class Span:
    """One sequence: tokens `start:end` of batch row `row`; `slot` is its state row.

    `slot` indexes `initial_state` (the slab with `state_indices`, else the
    sequence number); `slot < 0` marks a padding sequence (zero output, no state).
    """

    row: int
    start: int
    end: int
    slot: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Problem:
    """Every argument of `linear_attention`, validated, with derived sizes.

    Shapes (letters as in the docstring of `deltarule.linear_attention`):
    q [B,T,Hq,K], k [B,T,Hk,K], v [B,T,Hv,V], g [B,T,Hv], gk [B,T,Hv,K],
    beta [B,T,Hv], erase [B,T,Hv,K], write [B,T,Hv,V],
    initial_state [S,Hv,K,V] ("kv") or [S,Hv,V,K] ("vk") with S = N, or the
    slab size with `state_indices`.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    rule: str
    g: torch.Tensor | None
    gk: torch.Tensor | None
    beta: torch.Tensor | None
    erase: torch.Tensor | None
    write: torch.Tensor | None
    scale: float
    initial_state: torch.Tensor | DeviceSlab | None
    state_layout: str
    spans: tuple[Span, ...]
    in_place: bool
    varlen: bool
    qk_l2norm: bool
    l2norm_eps: float
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    beta_sigmoid: bool
    chunk_size: int

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def T(self) -> int:
        return self.q.shape[1]

    @property
    def Hq(self) -> int:
        return self.q.shape[2]

    @property
    def Hk(self) -> int:
        return self.k.shape[2]

    @property
    def Hv(self) -> int:
        return self.v.shape[2]

    @property
    def K(self) -> int:
        return self.q.shape[3]

    @property
    def V(self) -> int:
        return self.v.shape[3]

    @property
    def N(self) -> int:
        """Number of sequences (and of returned state rows without a slab)."""
        return len(self.spans)

    @property
    def Ho(self) -> int:
        """Output heads: Hq for the GQA form (Hq > Hv), Hv otherwise."""
        return max(self.Hq, self.Hv)

    @property
    def G(self) -> int:
        """Query heads per state head (GQA); 1 for the GVA form."""
        return max(self.Hq // self.Hv, 1)

    @property
    def decays(self) -> bool:
        return self.rule in GATED_RULES

    @property
    def retrieves(self) -> bool:
        return self.rule in DELTA_RULES

    @property
    def per_key_decay(self) -> bool:
        return self.gk is not None

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def max_len(self) -> int:
        return max((s.length for s in self.spans), default=0)
