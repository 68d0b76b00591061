"""Gradients (docs/design.md section 2, "Gradients"): every backend that claims them against
the float64 oracle's autograd (`reference.differentiable`), on the test.json cases and on
small cases of every option; the calls that cannot be differentiated refuse before any work;
the torch reverse walk passes gradcheck in float64; a tiny model trains.

The loss is (o * do).sum() + (state * dS).sum() with random do and dS (conftest.gradients).
"""

from functools import lru_cache

import pytest
import torch

import deltarule
from conftest import CPU, GRAD_TOL, assert_gradients_match, case_params, gradients, params
from conftest import small_case as small
from deltarule import ContractError, Unsupported, cases
from deltarule.backends import torch_backend
from deltarule.kernels.torch import recurrent_backward

BACKENDS = [CPU, "torch"]


def differentiable_case(case: dict) -> bool:
    """Calls autograd can follow: no slab, no capture buffer (its factors are not
    differentiated: refused), no overlapping (clamped, decreasing) sequences."""
    if case.get("state_indices") is not None or case.get("capture") is not None:
        return False
    cu = case.get("cu_seqlens")
    if cu is None:
        return True
    T = case["T"]
    spans = sorted((min(max(a, 0), T), min(max(b, 0), T)) for a, b in zip(cu, cu[1:]) if b > a)
    return all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:]))


@lru_cache(maxsize=None)
def oracle(name: str, dtype: str):
    case = next(c for c in cases.test_cases() if c["name"] == name)
    return gradients(cases.make_inputs(case, dtype), "reference")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("case", "dtype"), case_params(differentiable_case))
def test_case_gradients_match_the_oracle(case, dtype, backend, nan_poison):
    args = cases.make_inputs(case, dtype)
    assert_gradients_match(args, backend, GRAD_TOL[dtype], reference=oracle(case["name"], dtype))


SMALL = params(
    small(B=2, T=70, K=20, V=12),                                                   # two checkpoint chunks
    small(B=1, T=130, K=100, V=20, decay="gk", update="erase_write"),               # three; K, V not 2^n
    small(Hq=2, Hk=2, Hv=4, T=12, V=72, decay="g+gk"),                              # GVA
    small(Hq=4, Hk=2, Hv=2, T=12, update="erase_write"),                            # GQA, G = 2
    small(B=1, T=75, cu_seqlens=[0, 30, 30, 75], decay="gk"),                       # an empty sequence
    small(B=2, T=10, seq_lens=[4, 10], initial_state=False),                        # tokens outside every span
    small(B=1, T=70, decay="g+gk", update="erase_write", decay_resets=[3, 64, 65]),  # -inf log decay: resets
    small(T=12, qk_l2norm=True, beta_sigmoid=True, raw_gate=True),                  # Qwen3-Next's preprocessing
    small(B=1, T=12, decay="gk", update="erase_write", raw_gate=True, beta_sigmoid=True, state_layout="vk"),
    small(B=1, T=8, rule="linear", decay="none", update="none"),
    small(B=1, T=8, rule="gated", decay="gk", update="none"),
    small(B=1, T=8, rule="delta", decay="none", update="beta"),
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SMALL)
def test_small_gradients_match_the_oracle(case, backend, nan_poison):
    assert_gradients_match(cases.make_inputs(case), backend, GRAD_TOL["float32"])


# Calls with no work at all: no sequence, no token, every span empty, no batch row (issue 19:
# the C backward ran a worker slot it never filled when no (sequence, head) task existed).
ZERO_WORK = params(
    small(B=1, T=5, cu_seqlens=[0]),                                    # no sequence, tokens uncovered
    small(B=1, T=0, cu_seqlens=[0]),                                    # no sequence, no token
    small(B=1, T=4, cu_seqlens=[0, 0, 0], decay="gk", update="erase_write"),   # every span empty
    small(B=2, T=4, seq_lens=[0, 0]),
    small(B=2, T=0),                                                    # T = 0: states copied through
    small(B=0, T=3),                                                    # no batch row
    small(B=0, T=0, initial_state=False),
)


@pytest.mark.parametrize("plan", [False, True], ids=["indices", "plan"])
@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
@pytest.mark.parametrize("case", ZERO_WORK)
def test_zero_work_calls_run_forward_and_backward(case, backend, plan, nan_poison):
    args = cases.make_inputs(case)
    if plan:
        args["plan"] = deltarule.plan_batch(case["B"], case["T"], cu_seqlens=args.pop("cu_seqlens", None),
                                            seq_lens=args.pop("seq_lens", None))
    assert_gradients_match(args, backend, GRAD_TOL["float32"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_without_grad_get_none_and_outputs_stay_attached(backend):
    """Only the inputs that require grad get one; a cpu output is never silently detached."""
    args = cases.make_inputs(small(T=70, decay="gk"))
    v = args["v"].requires_grad_(True)
    o, state = deltarule.linear_attention(**args, backend=backend)
    assert o.grad_fn is not None and state.grad_fn is not None
    (o.sum() + state.sum()).backward()
    assert v.grad is not None and torch.isfinite(v.grad).all()
    assert all(args[n].grad is None for n in ("q", "k", "gk", "beta", "initial_state"))
    with torch.no_grad():
        o, state = deltarule.linear_attention(**args, backend=backend)
    assert o.grad_fn is None and not o.requires_grad


def test_auto_picks_a_backend_with_gradients():
    args = cases.make_inputs(small())
    args["q"].requires_grad_(True)
    o, _ = deltarule.linear_attention(**args)
    o.sum().backward()
    assert args["q"].grad is not None and torch.count_nonzero(args["q"].grad) > 0


def test_a_slab_with_grad_is_refused_before_any_work():
    args = cases.make_inputs(small(B=2, T=4, state_indices=[3, 1], num_slots=5))
    slab = args["initial_state"]
    before = slab.clone()
    args["k"].requires_grad_(True)
    with pytest.raises(ContractError, match="state_indices"):
        deltarule.linear_attention(**args)
    assert torch.equal(slab, before)
    slab.requires_grad_(True)
    args["k"].requires_grad_(False)
    with pytest.raises(ContractError, match="state_indices"):
        deltarule.linear_attention(**args)


def test_overlapping_sequences_with_grad_are_refused():
    args = cases.make_inputs(small(B=1, T=70, cu_seqlens=[0, 30, 20, 70]))
    args["v"].requires_grad_(True)
    with pytest.raises(ContractError, match="cu_seqlens"):
        deltarule.linear_attention(**args)


def test_a_backend_without_backward_declines():
    args = cases.make_inputs(small())
    args["q"].requires_grad_(True)
    with pytest.raises(Unsupported, match="backward"):
        deltarule.linear_attention(**args, backend="wgsl")


def test_unwritten_gradients_would_show(nan_poison):
    """Tokens outside every sequence get zero gradients (written, not left as NaN)."""
    args = cases.make_inputs(small(B=1, T=40, cu_seqlens=[5, 12, 30]))
    _, _, grads = gradients(args, "cpu")
    for name in ("q", "k", "v", "g", "beta"):
        assert torch.isfinite(grads[name]).all(), name
        assert torch.count_nonzero(grads[name][:, :5]) == 0 and torch.count_nonzero(grads[name][:, 30:]) == 0


@pytest.mark.parametrize("form", ["g-beta", "gk-erase_write-gqa", "linear"])
def test_torch_reverse_walk_passes_gradcheck(form):
    """The torch backend's autograd Function (kernels/torch/recurrent_backward.py) in float64 against
    finite differences, over two checkpoint chunks (the first recomputed from its start)."""
    gen = torch.Generator().manual_seed(3)
    N, L, H, K, V, G = 1, 5, 2, 3, 2, 2 if "gqa" in form else 1
    Hq = H if G == 1 else 1
    f64 = dict(dtype=torch.float64)
    q = torch.randn(N, L, Hq, G, K, generator=gen, **f64)
    k = torch.nn.functional.normalize(torch.randn(N, L, H if G == 1 else 1, K, generator=gen, **f64), dim=-1)
    v = torch.randn(N, L, H, V, generator=gen, **f64)
    lam = b = w = None
    if form == "g-beta":
        lam = -torch.rand(N, L, H, generator=gen, **f64)
        b = w = torch.rand(N, L, H, generator=gen, **f64)
    elif form.startswith("gk"):
        lam = -torch.rand(N, L, H, K, generator=gen, **f64)
        b, w = torch.rand(N, L, H, K, generator=gen, **f64), torch.rand(N, L, H, V, generator=gen, **f64)
    S0 = torch.randn(N, H, K, V, generator=gen, **f64)
    inputs = [x.requires_grad_(True) for x in (q, k, v, lam, b, w, S0) if x is not None]
    names = [n for n, x in zip("q k v lam b w S0".split(), (q, k, v, lam, b, w, S0)) if x is not None]

    def fn(*xs):
        x = dict(zip(names, xs))
        w_ = x["b"] if form == "g-beta" else x.get("w")
        return torch_backend.Recurrence.apply(0.7, 2, x["q"], x["k"], x["v"], x.get("lam"), x.get("b"), w_,
                                              x["S0"])

    checkpoint = recurrent_backward.CHECKPOINT
    recurrent_backward.CHECKPOINT = 2
    try:
        assert torch.autograd.gradcheck(fn, inputs)
    finally:
        recurrent_backward.CHECKPOINT = checkpoint


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tiny_model_trains(backend):
    """Embedding -> q, k, v, gates -> linear_attention over packed sequences -> logits: the loss of
    predicting the token two back falls."""
    torch.manual_seed(0)
    vocab, D, H, K = 12, 32, 2, 16
    emb = torch.nn.Embedding(vocab, D)
    proj = torch.nn.Linear(D, H * (3 * K + 2))
    head = torch.nn.Linear(H * K, vocab)
    params_ = [*emb.parameters(), *proj.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params_, lr=1e-2)
    cu = torch.tensor([0, 40, 64, 120], dtype=torch.int32)
    tokens = torch.randint(0, vocab, (1, 120), generator=torch.Generator().manual_seed(1))
    target = torch.roll(tokens, 2, dims=1)
    losses = []
    for _ in range(60):
        x = proj(emb(tokens)).view(1, 120, H, 3 * K + 2)
        q, k, v = x[..., :K], torch.nn.functional.normalize(x[..., K:2 * K], dim=-1), x[..., 2 * K:3 * K]
        g, beta = -torch.nn.functional.softplus(x[..., -2]), torch.sigmoid(x[..., -1])
        o, _ = deltarule.linear_attention(q, k, v, g=g, beta=beta, cu_seqlens=cu, backend=backend)
        loss = torch.nn.functional.cross_entropy(head(o.reshape(120, H * K)), target[0])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]
