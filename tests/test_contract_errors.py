"""Every invalid call raises `ContractError` before any work (docs/design.md section 2).

Each case starts from a valid call (`valid_args`) and breaks one thing. The
error must be a `ContractError` whose message names the argument and gives the
expected and the actual value; no backend may run, and no input may change.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deltarule
from deltarule import ContractError, Unsupported
from deltarule import backends as backend_registry

B, T, H, K, V = 2, 3, 2, 4, 5  # K != V so that swapped layouts are caught
SLOTS = 4  # rows of the state slab in the state_indices cases


def t(*shape, dtype=torch.float32):
    """A small random tensor; integer and bool dtypes get small integers."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(*shape).to(dtype)
    return torch.randint(0, 2, shape).to(dtype)


def ints(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


def valid_args(*, B=B, T=T, Hq=H, Hk=H, Hv=H, K=K, V=V, **overrides):
    """Keyword arguments of a valid `linear_attention` call, with `overrides` applied.

    The sizes build the default tensors (Gated DeltaNet: rule "gated_delta",
    scalar g and beta); an override of None removes that argument.
    """
    args = dict(
        q=t(B, T, Hq, K),
        k=torch.nn.functional.normalize(t(B, T, Hk, K), dim=-1),
        v=t(B, T, Hv, V),
        rule="gated_delta",
        g=-torch.rand(B, T, Hv),
        beta=torch.rand(B, T, Hv),
    )
    args.update(overrides)
    return args


def slab_args(**overrides):
    """A valid call on a state slab of SLOTS rows, sequences in rows 2 and 0."""
    return valid_args(**{"initial_state": t(SLOTS, H, K, V), "state_indices": ints(2, 0), **overrides})


def aliased(name: str) -> dict:
    """A slab call whose input `name` is a view of slab row 3 (which the call does not address:
    the rows' memory is still one buffer the call writes)."""
    slab = t(SLOTS, H, K, V)
    row = slab[3].view(-1)
    gates = dict(beta=None, erase=torch.rand(B, T, H, K), write=torch.rand(B, T, H, V)) \
        if name in ("erase", "write") else {}
    if name == "A_log":
        gates.update(A_log=row[:H], dt_bias=t(H))
    shape = {"q": (B, T, H, K), "k": (B, T, H, K), "v": (B, T, H, V), "g": (B, T, H), "beta": (B, T, H),
             "erase": (B, T, H, K), "write": (B, T, H, V)}.get(name)
    if shape is not None:
        gates[name] = row[:1].expand(shape) if name != "g" else -row[:1].abs().expand(shape)
    if name == "g":
        row.abs_().neg_()                           # a valid log decay that is also slab memory
        gates["g"] = row[:1].expand(shape)
    return dict(initial_state=slab, state_indices=ints(0, 1), **gates)


def case(id, match, **spec):
    """One invalid call: `spec` goes to `valid_args`; `match` must hit the message."""
    return pytest.param(spec, match, id=id)


def slab_case(id, match, **overrides):
    """A case on a state slab of SLOTS rows (`overrides` may replace the slab)."""
    return case(id, match, **{"initial_state": t(SLOTS, H, K, V), **overrides})


CASES = [
    # --- q, k, v: type, rank, dtype --------------------------------------------------
    case("q-rank-3", r"^q: .*rank-4", q=t(B, T, H * K)),
    case("k-rank-5", r"^k: .*rank-4", k=t(B, T, H, K, 1)),
    case("v-rank-3", r"^v: .*rank-4", v=t(B, T, H * V)),
    case("q-numpy", r"^q: .*torch\.Tensor.*ndarray", q=np.zeros((B, T, H, K), np.float32)),
    case("k-list", r"^k: .*torch\.Tensor.*list", k=[[0.0]]),
    case("v-none", r"^v: .*torch\.Tensor.*NoneType", v=None),
    case("q-int32", r"^q: .*dtype.*int32", q=t(B, T, H, K, dtype=torch.int32)),
    case("k-int64", r"^k: .*dtype.*int64", k=t(B, T, H, K, dtype=torch.int64)),
    case("v-float64", r"^v: .*dtype.*float64", v=t(B, T, H, V, dtype=torch.float64)),
    case("q-float64", r"^q: .*dtype.*float64", q=t(B, T, H, K, dtype=torch.float64)),
    case("q-complex64", r"^q: .*dtype.*complex64", q=t(B, T, H, K, dtype=torch.complex64)),
    case("k-float16-vs-q-float32", r"^k, v: .*float32.*k torch\.float16",
         k=t(B, T, H, K, dtype=torch.float16)),
    case("v-bfloat16-vs-q-float32", r"^k, v: .*float32.*v torch\.bfloat16",
         v=t(B, T, H, V, dtype=torch.bfloat16)),
    # --- q, k, v: sizes ---------------------------------------------------------------
    case("k-B-mismatch", r"^k: .*\(1, 3, 2, 4\)", k=t(1, T, H, K)),
    case("v-B-mismatch", r"^v: .*\(1, 3, 2, 5\)", v=t(1, T, H, V)),
    case("k-T-mismatch", r"^k: .*\(2, 2, 2, 4\)", k=t(B, 2, H, K)),
    case("v-T-mismatch", r"^v: .*\(2, 4, 2, 5\)", v=t(B, 4, H, V)),
    case("k-K-mismatch", r"^k: .*\(2, 3, 2, 3\)", k=t(B, T, H, K - 1)),
    case("q-K-zero", r"^q: .*K >= 1", q=t(B, T, H, 0), k=t(B, T, H, 0)),
    case("v-V-zero", r"^v: .*V >= 1", v=t(B, T, H, 0)),
    case("q-Hq-zero", r"^q: .*Hq, K >= 1", q=t(B, T, 0, K)),
    # --- heads ------------------------------------------------------------------------
    case("Hv-not-multiple-of-Hk", r"^v: .*multiple of Hk = 2.*Hv = 3", Hv=3),
    case("Hq-not-Hk-nor-multiple-of-Hv", r"^q: .*Hq = 3, Hk = 2, Hv = 2", Hq=3),
    case("Hq-multiple-of-Hv-but-Hv-not-Hk", r"^q: .*Hq = 4, Hk = 2, Hv = 4", Hq=4, Hv=4),
    case("Hq-smaller-than-Hk", r"^q: .*Hq = 1, Hk = 2, Hv = 2", Hq=1),
    # --- rule and gate presence -------------------------------------------------------
    case("rule-unknown", r"^rule: .*gated_delta.*'gdn'", rule="gdn"),
    case("rule-none", r"^rule: .*None", rule=None),
    case("rule-wrong-case", r"^rule: .*'Gated_Delta'", rule="Gated_Delta"),
    case("gated_delta-without-decay", r"^g: .*g and/or gk.*'gated_delta'", g=None),
    case("gated-without-decay", r"^g: .*g and/or gk.*'gated'", rule="gated", g=None, beta=None),
    case("delta-with-g", r"^g: .*None for rule 'delta'", rule="delta"),
    case("linear-with-gk", r"^gk: .*None for rule 'linear'",
         rule="linear", g=None, beta=None, gk=-torch.rand(B, T, H, K)),
    case("delta-without-beta", r"^beta: .*'delta'", rule="delta", g=None, beta=None),
    case("gated_delta-without-beta", r"^beta: .*'gated_delta'", beta=None),
    case("gated-with-beta", r"^beta: .*None for rule 'gated'", rule="gated"),
    case("linear-with-beta", r"^beta: .*None for rule 'linear'", rule="linear", g=None),
    case("linear-with-erase-write", r"^erase: .*None for rule 'linear'",
         rule="linear", g=None, beta=None, erase=torch.rand(B, T, H, K),
         write=torch.rand(B, T, H, V)),
    case("beta-with-erase-and-write", r"^beta: .*erase / write",
         erase=torch.rand(B, T, H, K), write=torch.rand(B, T, H, V)),
    case("beta-with-erase-only", r"^beta: .*erase / write", erase=torch.rand(B, T, H, K)),
    case("beta-with-write-only", r"^beta: .*erase / write", write=torch.rand(B, T, H, V)),
    case("erase-without-write", r"^write: .*erase and write.*write = None",
         beta=None, erase=torch.rand(B, T, H, K)),
    case("write-without-erase", r"^erase: .*erase and write.*erase = None",
         beta=None, write=torch.rand(B, T, H, V)),
    # --- gate shapes, types, dtypes ---------------------------------------------------
    case("g-extra-dim", r"^g: .*\[2, 3, 2\].*\[2, 3, 2, 1\]", g=-torch.rand(B, T, H, 1)),
    case("g-missing-head-dim", r"^g: .*\[2, 3, 2\].*\[2, 3\]", g=-torch.rand(B, T)),
    case("g-wrong-T", r"^g: .*\[2, 3, 2\].*\[2, 2, 2\]", g=-torch.rand(B, 2, H)),
    case("gk-V-not-K", r"^gk: .*\[2, 3, 2, 4\].*\[2, 3, 2, 5\]", g=None, gk=-torch.rand(B, T, H, V)),
    case("beta-extra-dim", r"^beta: .*\[2, 3, 2\].*\[2, 3, 2, 1\]", beta=torch.rand(B, T, H, 1)),
    case("erase-V-not-K", r"^erase: .*\[2, 3, 2, 4\].*\[2, 3, 2, 5\]",
         beta=None, erase=torch.rand(B, T, H, V), write=torch.rand(B, T, H, V)),
    case("write-K-not-V", r"^write: .*\[2, 3, 2, 5\].*\[2, 3, 2, 4\]",
         beta=None, erase=torch.rand(B, T, H, K), write=torch.rand(B, T, H, K)),
    case("g-int32", r"^g: .*dtype.*int32", g=t(B, T, H, dtype=torch.int32)),
    case("gk-bool", r"^gk: .*dtype.*bool", g=None, gk=t(B, T, H, K, dtype=torch.bool)),
    case("beta-int64", r"^beta: .*dtype.*int64", beta=t(B, T, H, dtype=torch.int64)),
    case("erase-complex64", r"^erase: .*dtype.*complex64",
         beta=None, erase=t(B, T, H, K, dtype=torch.complex64), write=torch.rand(B, T, H, V)),
    case("write-int32", r"^write: .*dtype.*int32",
         beta=None, erase=torch.rand(B, T, H, K), write=t(B, T, H, V, dtype=torch.int32)),
    case("g-list", r"^g: .*torch\.Tensor.*list", g=[0.0]),
    # --- device (meta tensors stand in for a second device) ---------------------------
    case("k-on-other-device", r"^k: .*device.*meta", k=torch.empty(B, T, H, K, device="meta")),
    case("g-on-other-device", r"^g: .*device.*meta", g=torch.empty(B, T, H, device="meta")),
    case("initial_state-on-other-device", r"^initial_state: .*device.*meta",
         initial_state=torch.empty(B, H, K, V, device="meta")),
    case("cu_seqlens-on-other-device", r"^cu_seqlens: .*device.*meta",
         B=1, cu_seqlens=ints(0, T).to("meta")),
    # --- scale ------------------------------------------------------------------------
    case("scale-nan", r"^scale: .*finite.*nan", scale=float("nan")),
    case("scale-inf", r"^scale: .*finite.*inf", scale=float("inf")),
    case("scale-minus-inf", r"^scale: .*finite.*-inf", scale=float("-inf")),
    case("scale-numpy-nan", r"^scale: .*finite.*nan", scale=np.float32("nan")),
    case("scale-str", r"^scale: .*real number.*'0\.5'", scale="0.5"),
    case("scale-complex", r"^scale: .*real number.*1j", scale=1j),
    case("scale-bool", r"^scale: .*real number.*True", scale=True),
    case("scale-huge-int", r"^scale: .*finite", scale=10**400),
    case("scale-inf-in-float32", r"^scale: .*finite in float32.*1e\+39", scale=1e39),      # finite in float64
    case("scale-minus-inf-in-float32", r"^scale: .*finite in float32.*-3\.5e\+38", scale=-3.5e38),
    # --- log decays: natural logs, never positive (issue 19: g=0.9 meant log(0.9)) --------
    case("g-positive", r"^g: .*log-space decays <= 0.*log\(0\.9\).*g\[0, 0, 0\] = 0\.9$",
         g=torch.full((B, T, H), 0.9)),
    case("g-one-positive-value", r"^g: .*<= 0.*g\[1, 2, 0\] = 1e-07",
         g=(-torch.rand(B, T, H)).index_put_((torch.tensor(1), torch.tensor(2), torch.tensor(0)), torch.tensor(1e-7))),
    case("g-plus-inf", r"^g: .*<= 0.*= inf", g=torch.full((B, T, H), float("inf"))),
    case("gk-positive", r"^gk: .*log-space decays <= 0.*gk\[0, 0, 0, 0\] = 0\.5",
         g=None, gk=torch.full((B, T, H, K), 0.5)),
    case("g-bfloat16-positive", r"^g: .*<= 0", g=torch.full((B, T, H), 0.25, dtype=torch.bfloat16)),
    # --- initial_state and state_layout -----------------------------------------------
    case("initial_state-kv-given-vk-shape", r"^initial_state: .*K, V.*\(2, 2, 5, 4\)",
         initial_state=t(B, H, V, K)),
    case("initial_state-vk-given-kv-shape", r"^initial_state: .*V, K.*\(2, 2, 4, 5\)",
         state_layout="vk", initial_state=t(B, H, K, V)),
    case("initial_state-wrong-N", r"^initial_state: .*\(3, 2, 4, 5\)", initial_state=t(B + 1, H, K, V)),
    case("initial_state-wrong-Hv", r"^initial_state: .*\(2, 1, 4, 5\)", initial_state=t(B, 1, K, V)),
    case("initial_state-rank-3", r"^initial_state: .*rank-4", initial_state=t(B, H, K * V)),
    case("initial_state-float64", r"^initial_state: .*float32, float16 or bfloat16.*float64",
         initial_state=t(B, H, K, V, dtype=torch.float64)),
    case("initial_state-int32", r"^initial_state: .*float32, float16 or bfloat16.*int32",
         initial_state=t(B, H, K, V, dtype=torch.int32)),
    case("initial_state-numpy", r"^initial_state: .*torch\.Tensor.*ndarray",
         initial_state=np.zeros((B, H, K, V), np.float32)),
    case("initial_state-N-vs-cu_seqlens", r"^initial_state: .*\(1, 2, 4, 5\)",
         B=1, cu_seqlens=ints(0, 1, T), initial_state=t(1, H, K, V)),
    case("state_layout-unknown", r"^state_layout: .*'kv' \| 'vk'.*'vk2'", state_layout="vk2"),
    case("state_layout-upper-case", r"^state_layout: .*'KV'", state_layout="KV"),
    case("state_layout-none", r"^state_layout: .*None", state_layout=None),
    # --- cu_seqlens and seq_lens ------------------------------------------------------
    case("cu_seqlens-float", r"^cu_seqlens: .*int32 or int64.*float32",
         B=1, cu_seqlens=torch.tensor([0.0, T])),
    case("cu_seqlens-bool", r"^cu_seqlens: .*int32 or int64.*bool",
         B=1, cu_seqlens=torch.tensor([False, True])),
    case("cu_seqlens-2d", r"^cu_seqlens: .*rank-1.*\[1, 2\]", B=1, cu_seqlens=ints(0, T).view(1, 2)),
    case("cu_seqlens-empty", r"^cu_seqlens: .*N \+ 1 >= 1.*\[0\]", B=1, cu_seqlens=ints()),
    case("cu_seqlens-list", r"^cu_seqlens: .*torch\.Tensor.*list", B=1, cu_seqlens=[0, T]),
    case("cu_seqlens-with-B-2", r"^cu_seqlens: .*B == 1.*B = 2", cu_seqlens=ints(0, T)),
    case("cu_seqlens-and-seq_lens", r"^seq_lens: .*cu_seqlens",
         B=1, cu_seqlens=ints(0, T), seq_lens=ints(T)),
    case("seq_lens-too-short", r"^seq_lens: .*\[2\].*\[1\]", seq_lens=ints(T)),
    case("seq_lens-too-long", r"^seq_lens: .*\[2\].*\[3\]", seq_lens=ints(T, T, T)),
    case("seq_lens-2d", r"^seq_lens: .*\[2\].*\[1, 2\]", seq_lens=ints(T, T).view(1, 2)),
    case("seq_lens-above-T", r"^seq_lens\[1\]: .*\[0, 3\].*4", seq_lens=ints(T, T + 1)),
    case("seq_lens-negative", r"^seq_lens\[0\]: .*\[0, 3\].*-1", seq_lens=ints(-1, T)),
    case("seq_lens-float", r"^seq_lens: .*int32 or int64.*float32", seq_lens=torch.tensor([1.0, 2.0])),
    case("seq_lens-int16", r"^seq_lens: .*int32 or int64.*int16", seq_lens=ints(1, 2, dtype=torch.int16)),
    # --- state_indices ----------------------------------------------------------------
    case("state_indices-without-initial_state", r"^initial_state: .*state_indices",
         state_indices=ints(0, 1)),
    slab_case("state_indices-too-short", r"^state_indices: .*\[2\].*\[1\]", state_indices=ints(0)),
    slab_case("state_indices-too-long", r"^state_indices: .*\[2\].*\[3\]", state_indices=ints(0, 1, 2)),
    slab_case("state_indices-out-of-range", r"^state_indices\[1\]: .*< 4.*got 4",
              state_indices=ints(0, SLOTS)),
    slab_case("state_indices-far-out-of-range", r"^state_indices\[0\]: .*< 4.*got 1000",
              state_indices=ints(1000, 0, dtype=torch.int64)),
    slab_case("state_indices-duplicate", r"^state_indices\[1\]: .*distinct.*1 repeated",
              state_indices=ints(1, 1)),
    slab_case("state_indices-float", r"^state_indices: .*int32 or int64.*float32",
              state_indices=torch.tensor([0.0, 1.0])),
    slab_case("state_indices-list", r"^state_indices: .*torch\.Tensor.*list", state_indices=[0, 1]),
    slab_case("slab-wrong-tail", r"^initial_state: .*\[S, Hv, K, V\].*\(4, 2, 5, 4\)",
              initial_state=t(SLOTS, H, V, K), state_indices=ints(0, 1)),
    # --- aliasing: a slab is written after the inputs are read (docs/design.md, "Aliasing") --
    slab_case("slab-expanded-rows", r"^initial_state: .*do not share memory.*strides \(0, 20, 5, 1\)",
              initial_state=t(1, H, K, V).expand(SLOTS, H, K, V), state_indices=ints(0, 1)),
    slab_case("slab-overlapping-rows", r"^initial_state: .*do not share memory.*strides \(20, 20, 5, 1\)",
              initial_state=t(200).as_strided((SLOTS, H, K, V), (K * V, K * V, V, 1)), state_indices=ints(0, 1)),
    slab_case("slab-stride-0-heads", r"^initial_state: .*do not share memory.*strides \(20, 0, 5, 1\)",
              initial_state=t(SLOTS, 1, K, V).expand(SLOTS, H, K, V), state_indices=ints(0, 1)),
    slab_case("slab-vk-expanded", r"^initial_state: .*do not share memory",
              initial_state=t(SLOTS, H, 1, K).expand(SLOTS, H, V, K), state_layout="vk", state_indices=ints(0, 1)),
    *(slab_case(f"{name}-view-of-a-slab-row", rf"^initial_state: .*no input shares.*got {name} shares",
                **aliased(name)) for name in ("q", "k", "v", "g", "beta", "erase", "write")),
    slab_case("slab-row-view-of-A_log", r"^initial_state: .*no input shares.*got A_log shares",
              **aliased("A_log")),
    # --- speculative decoding: 2-D state_indices [N, L], num_accepted_tokens -----------
    slab_case("state_indices-2d-wrong-N", r"^state_indices: .*\[2\] or shape \[2, L\].*\[3, 3\]",
              state_indices=ints(0, 1, 2, 3, -1, -1, -1, -1, -1).view(3, 3)),
    slab_case("state_indices-2d-L-zero", r"^state_indices: .*L >= 1.*\[2, 0\]",
              state_indices=ints().view(2, 0)),
    slab_case("state_indices-rank-3", r"^state_indices: .*\[2\] or shape \[2, L\].*\[2, 3, 1\]",
              state_indices=ints(0, 1, 2, 3, -1, -1).view(2, 3, 1)),
    slab_case("state_indices-2d-out-of-range", r"^state_indices\[1, 2\]: .*< 4.*got 4",
              state_indices=ints(0, 1, 2, 3, -1, 4).view(2, 3)),
    slab_case("state_indices-2d-out-of-range-past-length", r"^state_indices\[0, 3\]: .*< 4.*got 9",
              state_indices=ints(0, 1, 2, 9, -1, -1, -1, -1).view(2, 4)),
    slab_case("state_indices-2d-row-used-twice", r"^state_indices\[1, 1\]: .*distinct.*2 repeated",
              state_indices=ints(0, 1, 2, 3, 2, -1).view(2, 3)),
    slab_case("state_indices-2d-row-twice-in-a-sequence", r"^state_indices\[0, 2\]: .*distinct.*1 repeated",
              state_indices=ints(0, 1, 1, 3, -1, -1).view(2, 3)),
    slab_case("state_indices-2d-L-below-length", r"^state_indices: .*L >= every live sequence's length.*L = 2",
              state_indices=ints(0, 1, 2, 3).view(2, 2)),
    slab_case("num_accepted_tokens-without-state_indices", r"^num_accepted_tokens: .*2-D state_indices",
              initial_state=t(B, H, K, V), num_accepted_tokens=ints(1, 1)),
    slab_case("num_accepted_tokens-with-1d-state_indices", r"^num_accepted_tokens: .*2-D state_indices.*1-D",
              state_indices=ints(0, 1), num_accepted_tokens=ints(1, 1)),
    slab_case("num_accepted_tokens-zero", r"^num_accepted_tokens\[0\]: .*\[1, L = 3\].*got 0",
              state_indices=ints(0, 1, 2, 3, -1, -1).view(2, 3), num_accepted_tokens=ints(0, 1)),
    slab_case("num_accepted_tokens-above-L", r"^num_accepted_tokens\[1\]: .*\[1, L = 3\].*got 4",
              state_indices=ints(0, 1, 2, 3, -1, -1).view(2, 3), num_accepted_tokens=ints(1, 4)),
    slab_case("read-past-length-a-row-another-writes",
              r"^state_indices\[1, 2\]: .*no other live sequence writes.*3, written as state_indices\[0, 0\]",
              initial_state=t(6, H, K, V), seq_lens=ints(3, 2), state_indices=ints(3, 1, 2, 0, 4, 3).view(2, 3),
              num_accepted_tokens=ints(1, 3)),
    slab_case("num_accepted_tokens-wrong-length", r"^num_accepted_tokens: .*\[2\].*\[3\]",
              state_indices=ints(0, 1, 2, 3, -1, -1).view(2, 3), num_accepted_tokens=ints(1, 1, 1)),
    slab_case("num_accepted_tokens-float", r"^num_accepted_tokens: .*int32 or int64.*float32",
              state_indices=ints(0, 1, 2, 3, -1, -1).view(2, 3), num_accepted_tokens=torch.tensor([1.0, 1.0])),
    # --- plan ----------------------------------------------------------------------------
    case("plan-not-a-plan", r"^plan: .*BatchPlan.*dict", plan={}),
    case("plan-and-cu_seqlens", r"^cu_seqlens: .*None when a plan is given",
         B=1, plan=deltarule.plan_batch(1, T), cu_seqlens=ints(0, T)),
    case("plan-other-T", r"^plan: .*\[2, 3\].*\[2, 4\]", plan=deltarule.plan_batch(B, T + 1)),
    case("plan-other-B", r"^plan: .*\[2, 3\].*\[1, 3\]", plan=deltarule.plan_batch(1, T)),
    case("plan-other-device", r"^plan: .*device cpu.*meta", plan=deltarule.plan_batch(B, T, device="meta")),
    case("plan-slab-on-a-plain-state", r"^plan: .*2-row slab.*4-row slab",
         initial_state=t(B, H, K, V),
         plan=deltarule.plan_batch(B, T, state_indices=ints(0, 1), num_slots=SLOTS)),
    slab_case("plan-other-slab-size", r"^plan: .*4-row slab.*5-row slab",
              plan=deltarule.plan_batch(B, T, state_indices=ints(0, 1), num_slots=SLOTS + 1)),
    slab_case("plan-without-slab-on-slab", r"^initial_state: .*\[2, Hv, K, V\].*\(4, 2, 4, 5\)",
              plan=deltarule.plan_batch(B, T)),
    # --- chunk_size and backend ------------------------------------------------------
    case("chunk_size-zero", r"^chunk_size: .*>= 1.*got 0", chunk_size=0),
    case("chunk_size-negative", r"^chunk_size: .*>= 1.*got -16", chunk_size=-16),
    case("chunk_size-float", r"^chunk_size: .*int.*16\.0", chunk_size=16.0),
    case("chunk_size-bool", r"^chunk_size: .*int.*True", chunk_size=True),
    case("chunk_size-str", r"^chunk_size: .*int.*'64'", chunk_size="64"),
    case("chunk_size-none", r"^chunk_size: .*int.*None", chunk_size=None),
    case("backend-unknown", r"^backend: .*'auto'.*'nope'", backend="nope"),
    case("backend-empty", r"^backend: .*''", backend=""),
    case("backend-none", r"^backend: .*None", backend=None),
    case("backend-list", r"^backend: .*\['torch'\]", backend=["torch"]),
    # --- raw-gate arm: A_log / dt_bias --------------------------------------------------
    case("A_log-without-dt_bias", r"^dt_bias: .*A_log and dt_bias.*dt_bias = None", A_log=t(H)),
    case("dt_bias-without-A_log", r"^A_log: .*A_log and dt_bias.*A_log = None", dt_bias=t(H)),
    case("A_log-shape-beside-g", r"^A_log: .*\[2\].*\[2, 1\]", A_log=t(H, 1), dt_bias=t(H)),
    case("dt_bias-Hv-K-beside-g", r"^dt_bias: .*\[2\].*\[2, 4\]", A_log=t(H), dt_bias=t(H, K)),
    case("dt_bias-Hv-beside-gk", r"^dt_bias: .*\[2, 4\].*\[2\]",
         g=None, gk=t(B, T, H, K), A_log=t(H), dt_bias=t(H)),
    case("A_log-Hv-K-beside-gk", r"^A_log: .*\[2\].*\[2, 4\]",
         g=None, gk=t(B, T, H, K), A_log=t(H, K), dt_bias=t(H, K)),
    case("A_log-with-g-and-gk", r"^A_log: .*both g and gk",
         gk=t(B, T, H, K), A_log=t(H), dt_bias=t(H)),
    case("A_log-without-decay", r"^A_log: .*without a decay gate",
         rule="delta", g=None, A_log=t(H), dt_bias=t(H)),
    case("A_log-int32", r"^A_log: .*dtype.*int32", A_log=t(H, dtype=torch.int32), dt_bias=t(H)),
    case("dt_bias-list", r"^dt_bias: .*torch\.Tensor.*list", A_log=t(H), dt_bias=[0.0, 0.0]),
    # --- flags and eps ----------------------------------------------------------------
    case("beta_sigmoid-rule-gated", r"^beta_sigmoid: .*'gated'", rule="gated", beta=None, beta_sigmoid=True),
    case("beta_sigmoid-rule-linear", r"^beta_sigmoid: .*'linear'",
         rule="linear", g=None, beta=None, beta_sigmoid=True),
    case("beta_sigmoid-int", r"^beta_sigmoid: .*bool.*1", beta_sigmoid=1),
    case("qk_l2norm-int", r"^qk_l2norm: .*bool.*1", qk_l2norm=1),
    case("qk_l2norm-str", r"^qk_l2norm: .*bool.*'yes'", qk_l2norm="yes"),
    case("qk_l2norm-none", r"^qk_l2norm: .*bool.*None", qk_l2norm=None),
    case("l2norm_eps-negative", r"^l2norm_eps: .*>= 0.*-1e-06", l2norm_eps=-1e-6),
    case("l2norm_eps-nan", r"^l2norm_eps: .*finite.*nan", l2norm_eps=float("nan")),
    case("l2norm_eps-inf", r"^l2norm_eps: .*finite.*inf", l2norm_eps=float("inf")),
    case("l2norm_eps-str", r"^l2norm_eps: .*'1e-6'", l2norm_eps="1e-6"),
    case("l2norm_eps-bool", r"^l2norm_eps: .*True", l2norm_eps=True),
    case("l2norm_eps-huge-int", r"^l2norm_eps: .*finite", l2norm_eps=10**400),
    case("l2norm_eps-inf-in-float32", r"^l2norm_eps: .*finite in float32.*1e\+39", qk_l2norm=True, l2norm_eps=1e39),
]


@pytest.fixture
def no_backend_runs(monkeypatch):
    """Make any backend that starts work fail the test."""

    def refuse(problem):
        raise AssertionError("a backend ran on an invalid call")

    for module in backend_registry.REGISTRY.values():
        monkeypatch.setattr(module, "run", refuse)


def snapshot(args):
    """(name, version, clone) of every tensor with data among the arguments."""
    return [
        (name, x._version, x.clone())
        for name, x in args.items()
        if isinstance(x, torch.Tensor) and x.device.type != "meta"
    ]


def assert_untouched(args, before):
    for name, version, copy in before:
        x = args[name]
        assert x._version == version, f"{name} was modified in place"
        assert x.dtype == copy.dtype and x.shape == copy.shape, name
        assert torch.equal(bits(x), bits(copy)), f"{name} changed"


def bits(x):
    """The tensor's bytes, so that the comparison is bit-exact (-0.0, NaN)."""
    return x.detach().contiguous().reshape(-1).view(torch.uint8)


def raises_contract_error(args, match):
    with pytest.raises(ContractError, match=match) as info:
        deltarule.linear_attention(**args)
    return info.value


@pytest.mark.parametrize("spec, match", CASES)
def test_invalid_call_raises_contract_error(spec, match, no_backend_runs):
    args = valid_args(**spec)
    before = snapshot(args)
    err = raises_contract_error(args, match)
    message = str(err)
    assert message.startswith(f"{err.argument}: expected "), message
    assert err.expected and f"expected {err.expected}, got {err.actual}" in message
    assert_untouched(args, before)


@pytest.mark.parametrize(
    "spec, match", [p for p in CASES if "backend" not in p.values[0]]
)
def test_validation_is_shared_by_backends(spec, match):
    """reference, torch and `validate` itself give the same error for the same call."""
    messages = set()
    for backend in ("reference", "torch"):
        args = valid_args(**spec)
        args["backend"] = backend
        messages.add(str(raises_contract_error(args, match)))
    with pytest.raises(ContractError, match=match) as info:
        deltarule.validate(**valid_args(**spec))
    messages.add(str(info.value))
    assert len(messages) == 1, messages


def test_valid_base_calls_run():
    """The starting points of the cases are valid, so each case breaks one thing."""
    for args in (valid_args(), slab_args(), valid_args(B=1, cu_seqlens=ints(0, 1, T))):
        o, state = deltarule.linear_attention(**args, backend="reference")
        assert o.shape == (args["q"].shape[0], T, H, V)
        assert state.dtype == torch.float32


@pytest.mark.parametrize("backend", ["auto", "reference", "torch"])
@pytest.mark.parametrize(
    "overrides, match",
    [
        pytest.param(dict(state_indices=ints(3, 3)), r"^state_indices\[1\]: .*distinct",
                     id="duplicate-index"),
        pytest.param(dict(state_indices=ints(0, SLOTS)), r"^state_indices\[1\]: .*< 4",
                     id="index-out-of-range"),
        pytest.param(dict(chunk_size=0), r"^chunk_size:", id="chunk_size-zero"),
        pytest.param(dict(beta=torch.rand(B, T, H, 1)), r"^beta:", id="bad-beta-shape"),
        pytest.param(dict(scale=float("nan")), r"^scale:", id="scale-nan"),
        pytest.param(dict(l2norm_eps=-1.0, qk_l2norm=True), r"^l2norm_eps:", id="l2norm_eps-negative"),
    ],
)
def test_failed_slab_call_leaves_every_input_untouched(overrides, match, backend, no_backend_runs):
    args = slab_args(**overrides, backend=backend)
    slab = args["initial_state"]
    slab_copy = slab.clone()
    qkv_copy = [args[name].clone() for name in ("q", "k", "v")]
    versions = {name: args[name]._version for name in ("q", "k", "v", "initial_state")}

    raises_contract_error(args, match)

    assert torch.equal(bits(slab), bits(slab_copy))
    for name, copy in zip(("q", "k", "v"), qkv_copy):
        assert torch.equal(bits(args[name]), bits(copy)), name
    assert {name: args[name]._version for name in versions} == versions


def test_unknown_backend_on_slab_call_leaves_slab_untouched():
    """`backend` is checked in dispatch, after validation, still before any work."""
    args = slab_args(backend="nope")
    slab_copy = args["initial_state"].clone()
    raises_contract_error(args, r"^backend: .*'nope'")
    assert torch.equal(bits(args["initial_state"]), bits(slab_copy))


def test_exception_classes():
    assert issubclass(ContractError, ValueError)
    assert issubclass(Unsupported, Exception)
    assert not issubclass(Unsupported, ContractError)
    assert deltarule.ContractError is ContractError
    assert deltarule.Unsupported is Unsupported
    err = ContractError("chunk_size", "an int >= 1", 0)
    assert (err.argument, err.expected, err.actual) == ("chunk_size", "an int >= 1", 0)
    assert str(err) == "chunk_size: expected an int >= 1, got 0"
    with pytest.raises(ValueError):
        deltarule.linear_attention(**valid_args(chunk_size=0))
