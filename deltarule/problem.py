"""A validated call: what the API hands to every backend.

`Problem` holds the caller's tensors untouched, the validated scalars, and the
`BatchPlan` (sequences, state rows, output owners: `deltarule.batch`).
Backends read it and never re-validate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import BatchPlan, Span

RULES = ("linear", "gated", "delta", "gated_delta")
GATED_RULES = ("gated", "gated_delta")
DELTA_RULES = ("delta", "gated_delta")
LAYOUTS = ("kv", "vk")
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
STATE_DTYPES = INPUT_DTYPES         # storage only: the state is float32 between a sequence's tokens


class DeviceSlab:
    """A state slab that lives in an accelerator's memory outside torch.

    Accepted as `initial_state` together with `state_indices`; only the backend
    named by `backend` runs on it. Subclasses set `backend`, `layout` ("kv" or
    "vk") and `shape`: (S, Hv, K, V) for "kv", (S, Hv, V, K) for "vk".
    """

    backend: str
    layout: str
    shape: tuple[int, int, int, int]


def differentiable_inputs(q, k, v, g, gk, beta, erase, write, A_log, dt_bias, initial_state):
    """(q, k, v, g, gk, beta, erase, write, A_log, dt_bias, initial_state): the arguments of
    `linear_attention` that gradients reach; a device slab is not one."""
    state = initial_state if isinstance(initial_state, torch.Tensor) else None
    return q, k, v, g, gk, beta, erase, write, A_log, dt_bias, state


@dataclass(frozen=True)
class Problem:
    """Every argument of `linear_attention`, validated, with derived sizes.

    Shapes (letters as in the docstring of `deltarule.linear_attention`):
    q [B,T,Hq,K], k [B,T,Hk,K], v [B,T,Hv,V], g [B,T,Hv], gk [B,T,Hv,K],
    beta [B,T,Hv], erase [B,T,Hv,K], write [B,T,Hv,V],
    initial_state [S,Hv,K,V] ("kv") or [S,Hv,V,K] ("vk") with S = N, or the
    slab size with `state_indices`; `plan` the batch layout.
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
    plan: BatchPlan
    qk_l2norm: bool
    l2norm_eps: float
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    beta_sigmoid: bool
    chunk_size: int
    capture: torch.Tensor | None   # [N, C * (Dw + Hk*K + Hv*V)] float32, written in place (design.md)
    # the sizes, read once by the validation (a decode step's backends read them dozens of times)
    B: int
    T: int
    Hq: int
    Hk: int
    Hv: int
    K: int
    V: int
    G: int          # query heads per state head (GQA); 1 for the GVA form
    Ho: int         # output heads: Hq for the GQA form (Hq > Hv), Hv otherwise
    state_dtype: torch.dtype   # the state's storage dtype: initial_state's, float32 without one
    device: torch.device
    requires_grad: bool        # autograd is on and a differentiable input requires grad
    accept_growth: bool        # positive log decays accepted (the adapters of runtimes that take them)

    def differentiable_inputs(self) -> tuple[torch.Tensor | None, ...]:
        """The inputs a gradient can flow to, in the API's order (None where absent)."""
        return differentiable_inputs(self.q, self.k, self.v, self.g, self.gk, self.beta, self.erase,
                                     self.write, self.A_log, self.dt_bias, self.initial_state)

    @property
    def spans(self) -> tuple[Span, ...]:
        return self.plan.spans

    @property
    def N(self) -> int:
        """Number of sequences (and of returned state rows without a slab)."""
        return self.plan.N

    @property
    def in_place(self) -> bool:
        """`initial_state` is a slab updated in place (`state_indices`)."""
        return self.plan.in_place

    @property
    def varlen(self) -> bool:
        return self.plan.varlen

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
    def max_len(self) -> int:
        return self.plan.max_len

    @property
    def decay_width(self) -> int:
        """Dw, the decay factors of one captured transition: Hv * K with per-key decay, else Hv."""
        return self.Hv * self.K if self.gk is not None else self.Hv

    @property
    def capacity(self) -> int:
        """C, the transitions a capture row holds per sequence; 0 without `capture`."""
        if self.capture is None:
            return 0
        return self.capture.shape[1] // (self.decay_width + self.Hk * self.K + self.Hv * self.V)

    @property
    def token_serial(self) -> bool:
        """The call must run token by token: it stores per-token states (a speculative plan) or
        captures transitions; the chunked form forms neither."""
        return self.plan.speculative or self.capture is not None

    def capture_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of `capture`: (decay [N, C, Dw], key [N, C, Hk, K], delta [N, C, Hv, V])."""
        return capture_parts(self.capture, self.capacity, self.decay_width, self.Hk, self.K, self.Hv, self.V)


def capture_parts(capture: torch.Tensor, C: int, Dw: int, Hk: int, K: int, Hv: int, V: int):
    """The struct-of-arrays views of a capture buffer [N, C * (Dw + Hk*K + Hv*V)]: (decay
    [N, C, Dw], key [N, C, Hk, K], delta [N, C, Hv, V]); writes through them fill the buffer."""
    N = capture.shape[0]
    decay = capture[:, : C * Dw].view(N, C, Dw)
    key = capture[:, C * Dw: C * (Dw + Hk * K)].view(N, C, Hk, K)
    delta = capture[:, C * (Dw + Hk * K):].view(N, C, Hv, V)
    return decay, key, delta
