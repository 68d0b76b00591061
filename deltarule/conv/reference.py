"""`reference_conv1d_slab`: the float64 twin of `causal_conv1d_slab`, a loop over sequences
(the tests' and the vLLM plugin's shadow check's reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_conv1d_slab(x, weight, bias, conv_state, *, lengths, read_rows, write_rows, fresh=None,
                          accepted=None, activation="silu"):
    """float64 twin of `causal_conv1d_slab`, one sequence at a time: returns (out [T, C] float64,
    the updated slab as a float64 copy). Takes `plan_conv`'s arguments instead of a plan."""
    W = weight.shape[1]
    x, w = x.double(), weight.double()
    state = conv_state.double().clone()
    old = conv_state.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    start = 0
    for n, L in enumerate(lengths):
        o = accepted[n] - 1 if accepted is not None else 0
        prior = torch.zeros(W - 1, x.shape[1], dtype=torch.float64) \
            if (fresh is not None and fresh[n]) or read_rows[n] < 0 else old[read_rows[n], o:o + W - 1]
        seq = torch.cat((prior, x[start:start + L]))
        for i in range(L):
            acc = (seq[i:i + W] * w.T).sum(0) + (bias.double() if bias is not None else 0)
            out[start + i] = F.silu(acc) if activation == "silu" else acc
        if L and write_rows[n] >= 0:
            if accepted is not None:
                state[write_rows[n], :W - 2 + L] = torch.cat((prior[1:], x[start:start + L]))
            else:
                state[write_rows[n], :W - 1] = seq[-(W - 1):] if W > 1 else seq[:0]
        start += L
    return out, state
