"""The chunked (WY) backward of the torch backend (kernels/torch/chunked_backward.py, docs/algorithm.md
section 7): each stage against autograd through the matching piece of the forward; the whole
backward against the token-serial walk (`recurrent_backward.backward`) in float64; the torch
backend's gradients, now chunked past RECURRENT_MAX_LEN tokens, against the float64 oracle
(conftest.assert_gradients_match); float64 gradcheck of the chunked path.
"""

import pytest
import torch

from conftest import assert_gradients_match, params, rel
from conftest import small_case as small
from deltarule import cases
from deltarule.backends import torch_backend
from deltarule.kernels.torch import chunked_backward as cb
from deltarule.kernels.torch import recurrent_backward as rb
from deltarule.kernels.torch.chunked import LOG_DECAY_FLOOR

F64 = torch.float64
SCALE = 0.6


def operands(form: str, N=2, L=70, H=2, K=8, V=6, Hk=None, Hq1=None, G=1, seed=0, reset=None):
    """float64 operands in `recurrent`'s token-major contract for a gate form
    `<decay>-<update>`: decay g (scalar), gk (per key) or none; update beta (b = w, one
    tensor), erase_write (per-channel b and w) or none (no retrieval)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    uni = lambda *s: torch.rand(*s, generator=gen, dtype=F64)   # noqa: E731
    Hk, Hq1 = Hk or H, Hq1 or H
    decay, update = form.split("-")
    q = rnd(N, L, Hq1, G, K)
    k = torch.nn.functional.normalize(rnd(N, L, Hk, K), dim=-1)
    v = rnd(N, L, H, V)
    lam = {"g": lambda: -uni(N, L, H), "gk": lambda: -uni(N, L, H, K), "none": lambda: None}[decay]()
    if reset is not None and lam is not None:
        lam[:, reset] = float("-inf")
    b = w = None
    if update == "beta":
        b = w = uni(N, L, H)
    elif update == "erase_write":
        b, w = uni(N, L, H, K), uni(N, L, H, V)
    S0 = rnd(N, H, K, V)
    return q, k, v, lam, b, w, S0


def forward_states(x):
    """The checkpointed forward in float64 (token by token): o, the final state, the starts."""
    return rb.checkpointed(*x, SCALE, 64, recurrent_max_len=1 << 30)


def upstream(o, S, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(o.shape, generator=gen, dtype=F64), torch.randn(S.shape, generator=gen, dtype=F64)


def chunk_major(x, C=64):
    """The operands chunk-major ([n, N, H, (G,) C, ...]), lam clamped, as `backward` forms them."""
    q, k, v, lam, b, w, _ = x
    H = v.shape[2]
    Cp = 1 << (C - 1).bit_length() if lam is not None and lam.dim() == 4 else C
    ch = lambda t: None if t is None else cb._chunks(t, C, Cp, H)  # noqa: E731
    lam = None if lam is None else lam.clamp_min(LOG_DECAY_FLOOR)
    bc = ch(b)
    return (ch(q).transpose(-3, -2), ch(k), ch(v), ch(lam), bc, bc if w is b else ch(w))


def assert_close(got: dict, want: dict, tol=1e-10):
    bad = {n: f"{rel(got[n], want[n]):.1e}" for n in want if not rel(got[n], want[n]) <= tol}
    assert not bad, bad


# --- stages against autograd through the matching piece of the forward ---------------------

STAGE_FORMS = ["g-beta", "gk-beta", "gk-erase_write"]


@pytest.mark.parametrize("form", STAGE_FORMS + ["g-none", "none-beta"])
def test_recompute_reproduces_the_forward(form):
    """Stage 1: from the chunk-entry states, O = scale [(Q e^G) S0 + M U] and
    S_C = e^{G_C} S0 + K̂^T U are the token recurrence's outputs and next chunk-entry states."""
    x = operands(form, L=130, G=2, Hq1=1)
    o, S, starts = forward_states(x)
    qc, kc, vc, lc, bc, wc = chunk_major(x)
    S0 = starts.transpose(0, 1)
    r = cb.recompute(qc, kc, vc, lc, bc, wc, S0)
    O = SCALE * (r.q_dec @ S0.unsqueeze(-3) + r.M @ r.U.unsqueeze(-3))         # [n, N, H, G, C, V]
    S_next = r.s_dec * S0 + r.k_dec.transpose(-1, -2) @ r.U
    assert rel(cb._tokens(O.transpose(-3, -2), 64, 130), o) < 1e-12
    assert rel(S_next[:-1], S0[1:]) < 1e-12 and rel(S_next[-1], S) < 1e-12


@pytest.mark.parametrize("form", STAGE_FORMS)
def test_state_stages_match_autograd_through_the_chunk_loop(form):
    """Stages 2-4 (local dv, the reverse state pass, the state products) against autograd
    through the forward's chunk loop, with Ũ, Y, M, the cumulative decay, q, k and the
    entering state as leaves."""
    x = operands(form, L=130, G=2, Hq1=1)
    o, S, starts = forward_states(x)
    do, dS = upstream(o, S)
    qc, kc, vc, lc, bc, wc = chunk_major(x)
    doc = cb._chunks(do, 64, 64, 2).transpose(-3, -2)
    S0 = starts.transpose(0, 1)
    r = cb.recompute(qc, kc, vc, lc, bc, wc, S0)

    dU = cb.local_dv(r, doc, SCALE)
    dS_end, dS0 = cb.reverse_state_pass(r, doc, dU, dS, SCALE)
    st = cb.state_products(r, doc, dU, dS_end, S0, SCALE)

    leaf = lambda t: t.detach().clone().requires_grad_(True)  # noqa: E731
    Uf, Y, M, Gc, q, k, S_first = map(leaf, (r.T @ r.WV, r.Y, r.M, r.Gc, qc, kc, starts[:, 0]))
    if r.per_key:
        e_G, e_end, s_dec = Gc.exp(), (Gc[..., -1:, :] - Gc).exp(), Gc[..., -1, :, None].exp()
    else:
        e_G, e_end = Gc.exp()[..., None], (Gc[..., -1:] - Gc).exp()[..., None]
        s_dec = Gc[..., -1, None, None].exp()
    q_dec, k_dec = q * e_G.unsqueeze(-3), k * e_end
    state, loss = S_first, 0.0
    for i in range(r.k.shape[0]):
        U_i = Uf[i] - Y[i] @ state
        O_i = SCALE * (q_dec[i] @ state.unsqueeze(-3) + M[i].tril() @ U_i.unsqueeze(-3))
        loss = loss + (O_i * doc[i]).sum()
        state = s_dec[i] * state + k_dec[i].transpose(-1, -2) @ U_i
    loss = loss + (state * dS).sum()
    loss.backward()
    assert_close({"dU": st.dU, "dY": st.dY, "dM": st.dM, "dG": st.dG, "dS0": dS0,
                  "dq": st.dq_dec * e_G.detach().unsqueeze(-3), "dk": st.dk_dec * e_end.detach()},
                 {"dU": Uf.grad, "dY": Y.grad, "dM": M.grad, "dG": Gc.grad, "dS0": S_first.grad,
                  "dq": q.grad, "dk": k.grad})


@pytest.mark.parametrize("form", STAGE_FORMS)
def test_wy_backward_matches_autograd_through_the_inverse(form):
    """Stage 5: Ũ = T WV, Y = T E with T = (I + A)^-1 (torch.linalg.inv under autograd)."""
    x = operands(form, L=130)
    _, _, starts = forward_states(x)
    r = cb.recompute(*chunk_major(x), starts.transpose(0, 1))
    gen = torch.Generator().manual_seed(2)
    dU, dY = torch.randn(r.U.shape, generator=gen, dtype=F64), torch.randn(r.Y.shape, generator=gen, dtype=F64)
    wy = cb.wy_backward(r, dU, dY)
    A, WV, E = (t.detach().clone().requires_grad_(True) for t in (r.A, r.WV, r.E))
    C = A.shape[-1]
    T = torch.linalg.inv(torch.eye(C, dtype=F64) + A.tril(-1))
    ((T @ WV * dU).sum() + (T @ E * dY).sum()).backward()
    assert_close({"dWV": wy.dWV, "dE": wy.dE, "dA": wy.dA}, {"dWV": WV.grad, "dE": E.grad, "dA": A.grad})


@pytest.mark.parametrize("form", STAGE_FORMS + ["g-none", "gk-none"])
def test_gate_stages_match_autograd_through_the_intra_chunk_forward(form):
    """Stages 6-7 (Γ products into dq, dk, db, dw, dv and the decay gradient; the reverse
    cumulative sum): random dM, dA, dE, d(WV) pulled back by autograd through `recompute`
    itself (the per-key halving factorisation, the masks, the products)."""
    x = operands(form, L=100, G=2, Hq1=1, reset=70)
    _, _, starts = forward_states(x)
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in chunk_major(x)]
    if x[4] is x[5] and x[4] is not None:
        leaves[5] = leaves[4]                                 # scalar beta: one tensor
    r = cb.recompute(*leaves, starts.transpose(0, 1))
    gen = torch.Generator().manual_seed(4)
    rnd = lambda t: None if t is None else torch.randn(t.shape, generator=gen, dtype=F64)  # noqa: E731
    dM = rnd(r.M).tril()
    dA = None if r.A is None else rnd(r.A).tril(-1)
    dE, dWV = rnd(r.E), rnd(r.WV)
    loss = (r.M * dM).sum() + (r.WV * dWV).sum()
    if dA is not None:
        loss = loss + (r.A * dA).sum() + (r.E * dE).sum()
    loss.backward()
    zero = lambda t: torch.zeros_like(t)  # noqa: E731
    st = cb.StateTerms(dq_dec=zero(r.q), dM=dM, dk_dec=zero(r.k), dY=None, dU=None, dG=zero(r.Gc))
    g = cb.gate_products(r, st, cb.WYTerms(dWV=dWV, dE=dE, dA=dA))
    got = {"dq": g.dq, "dk": g.dk, "dv": g.dv, "dlam": cb.decay_gradient(g.dG, leaves[3])}
    want = {"dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad, "dlam": leaves[3].grad}
    if r.w is not None and r.w is r.b:                        # scalar beta: both parts reach it
        got["db"], want["db"] = g.db.sum(-1) + g.dw.sum(-1), leaves[4].grad
    elif r.b is not None:
        got["db"], got["dw"], want["db"], want["dw"] = g.db, g.dw, leaves[4].grad, leaves[5].grad
    assert_close(got, want)


def test_pairwise_per_key_backward_matches_autograd():
    """The reverse of `_pairwise_per_key` (recursive halving, same reference tokens)."""
    from deltarule.kernels.torch.chunked import _pairwise_per_key

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 16, 5, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(3, 16, 5, generator=gen, dtype=F64, requires_grad=True)
    Gc = (-torch.rand(3, 16, 5, generator=gen, dtype=F64)).cumsum(-2).requires_grad_(True)
    dP = torch.randn(3, 2, 16, 16, generator=gen, dtype=F64)
    (_pairwise_per_key(x, k, Gc) * dP).sum().backward()
    dx, dk = cb._pairwise_per_key_backward(dP, x.detach(), k.detach(), Gc.detach())
    dG = (x * dx).sum(-3) - k * dk
    assert_close({"dx": dx, "dk": dk, "dG": dG.detach()}, {"dx": x.grad, "dk": k.grad, "dG": Gc.grad})


# --- the whole backward against the token-serial walk ---------------------------------------

FORMS = ["g-beta", "gk-beta", "gk-erase_write", "g-erase_write", "none-beta", "none-none", "gk-none"]
HEADS = {"H": dict(), "GVA": dict(H=4, Hk=2, Hq1=2), "GQA": dict(H=2, Hk=1, Hq1=2, G=2)}


def assert_matches_the_walk(x):
    """The chunked backward of operands x equals the token walk's (every gradient, the same
    Nones); returns the chunked gradients."""
    o, S, starts = forward_states(x)
    do, dS = upstream(o, S)
    ref = rb.backward(*x[:6], starts, SCALE, do, dS, [True] * 7)
    got = cb.backward(*x[:6], starts, SCALE, do, dS, [True] * 7)
    assert [t is None for t in got] == [t is None for t in ref]
    names = "dq dk dv dlam db dw dS0".split()
    assert_close({n: t for n, t in zip(names, got) if t is not None},
                 {n: t for n, t in zip(names, ref) if t is not None})
    return got


@pytest.mark.parametrize("L", [1, 63, 65, 130], ids=lambda L: f"T{L}")
@pytest.mark.parametrize("form", FORMS)
def test_backward_matches_the_token_walk(form, L):
    x = operands(form, L=L, reset=40 if L > 40 else None)
    got = assert_matches_the_walk(x)
    if L > 40 and x[3] is not None:                           # the reset's decay gets no gradient
        assert torch.count_nonzero(got[3][:, 40]) == 0


@pytest.mark.parametrize("heads", list(HEADS), ids=str)
@pytest.mark.parametrize("form", ["g-beta", "gk-erase_write"])
def test_backward_matches_the_token_walk_across_head_layouts(form, heads):
    x = operands(form, L=70, **HEADS[heads])
    assert_matches_the_walk(x)


@pytest.mark.parametrize("form", ["g-beta", "gk-erase_write"])
def test_groups_of_one_chunk_give_the_same_gradients(form, monkeypatch):
    """Memory bound: chunks go in groups (last group first); one chunk per group changes nothing."""
    monkeypatch.setattr(cb, "GROUP_ELEMENTS", 1)
    x = operands(form, L=200, N=1)
    assert_matches_the_walk(x)


def test_backward_without_a_final_state_gradient_and_needs():
    """dS None (the final state unused) and `needs` give the walk's results and Nones."""
    x = operands("gk-beta", L=70)
    o, S, starts = forward_states(x)
    do, _ = upstream(o, S)
    needs = [True, False, True, True, False, True, False]
    ref = rb.backward(*x[:6], starts, SCALE, do, None, needs)
    got = cb.backward(*x[:6], starts, SCALE, do, None, needs)
    for a, b in zip(got, ref):
        assert (a is None) == (b is None)
        if a is not None:
            assert rel(a, b) < 1e-10


# --- the torch backend against the float64 oracle -------------------------------------------

@pytest.fixture
def spy(monkeypatch):
    """Counts the calls of the chunked backward (through the torch backend too)."""
    calls = []
    real = cb.backward
    monkeypatch.setattr(cb, "backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


BACKEND = params(
    small(T=40),                                                                    # scalar g + beta
    small(B=1, T=65, decay="gk"),                                                   # per-key gk + beta
    small(B=1, T=63, decay="gk", update="erase_write"),
    small(B=1, T=130, K=100, V=20, decay="gk", update="erase_write"),               # K not 2^n, 3 chunks
    small(B=1, T=70, decay="g+gk"),
    small(B=1, T=70, rule="delta", decay="none", update="beta"),                   # no decay
    small(B=1, T=70, rule="linear", decay="none", update="none", initial_state=False),
    small(B=1, T=70, rule="gated", decay="gk", update="none"),
    small(Hq=2, Hk=2, Hv=4, T=40, V=20, decay="g+gk"),                              # GVA
    small(Hq=4, Hk=2, Hv=2, T=40, update="erase_write"),                            # GQA, G = 2
    small(B=1, T=75, cu_seqlens=[0, 30, 30, 75], decay="gk"),                       # an empty sequence
    small(B=1, T=70, decay="g+gk", update="erase_write", decay_resets=[3, 64, 65]),  # -inf: resets
    small(B=1, T=70, decay="g", decay_resets=[10, 63]),
    small(T=40, qk_l2norm=True, beta_sigmoid=True, raw_gate=True),
    small(B=1, T=1024, Hq=1, Hk=1, Hv=1, K=16, V=16, decay="gk", decay_range=[-5.0, -1.0]),   # strong, long
    small(B=1, T=1024, Hq=1, Hk=1, Hv=1, K=16, V=16, decay="g", decay_range=[-5.0, -1.0]),
)


@pytest.mark.parametrize("case", BACKEND)
def test_torch_backend_gradients_match_the_oracle(case, spy, nan_poison):
    assert_gradients_match(cases.make_inputs(case), "torch", 1e-4)
    assert spy, "the chunked backward was not used"


@pytest.mark.parametrize("case", params(small(B=1, T=1), small(B=2, T=5, decay="gk", update="erase_write")))
def test_short_sequences_through_the_chunked_path(case, spy, monkeypatch):
    """Below RECURRENT_MAX_LEN the token walk runs; forced through the chunked backward
    (the threshold set to 0), T = 1 and T = 5 still match the oracle."""
    assert_gradients_match(cases.make_inputs(case), "torch", 1e-4)
    assert not spy
    monkeypatch.setattr(torch_backend, "RECURRENT_MAX_LEN", 0)
    assert_gradients_match(cases.make_inputs(case), "torch", 1e-4)
    assert spy


def test_supports_names_the_chunked_backward():
    assert "chunked" in torch_backend.SUPPORTS["gradients"]


# --- gradcheck ------------------------------------------------------------------------------

@pytest.mark.parametrize(("form", "chunk"), [("g-beta", 4), ("gk-erase_write-gqa", 4), ("g+gk-beta", 3),
                                             ("none-none", 4)])
def test_chunked_backward_passes_gradcheck(form, chunk, monkeypatch, spy):
    """The autograd Function in float64 against finite differences through the chunked
    backward: L = 18 > RECURRENT_MAX_LEN, checkpoints every `chunk` tokens (3: per-key chunks
    padded to 4 with identity steps), so the forward still runs token by token in float64."""
    monkeypatch.setattr(rb, "CHECKPOINT", chunk)
    gen = torch.Generator().manual_seed(3)
    N, L, H, K, V, G = 1, 18, 2, 3, 2, 2 if "gqa" in form else 1
    Hq = H if G == 1 else 1
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    uni = lambda *s: torch.rand(*s, generator=gen, dtype=F64)   # noqa: E731
    q = rnd(N, L, Hq, G, K)
    k = torch.nn.functional.normalize(rnd(N, L, H if G == 1 else 1, K), dim=-1)
    v = rnd(N, L, H, V)
    lam = b = w = None
    if form.startswith("g-"):
        lam = -uni(N, L, H)
    elif form.startswith("g"):
        lam = -uni(N, L, H, K)
    if "-beta" in form:
        b = uni(N, L, H)
    elif "erase_write" in form:
        b, w = uni(N, L, H, K), uni(N, L, H, V)
    S0 = rnd(N, H, K, V)
    names = [n for n, t in zip("q k v lam b w S0".split(), (q, k, v, lam, b, w, S0)) if t is not None]
    inputs = [t.requires_grad_(True) for t in (q, k, v, lam, b, w, S0) if t is not None]

    def fn(*xs):
        x = dict(zip(names, xs))
        w_ = x["b"] if "-beta" in form else x.get("w")
        return torch_backend.Recurrence.apply(0.7, 2, x["q"], x["k"], x["v"], x.get("lam"), x.get("b"), w_,
                                              x["S0"])

    assert torch.autograd.gradcheck(fn, inputs)
    assert spy
