"""The triton backend's gradients (kernels/triton/backward.py) against the float64 reference's autograd.

Every differentiable input (q, k, v, g, gk, beta, erase, write, A_log, dt_bias,
initial_state) gets the gradient of loss = (o * do).sum() + (state * dS).sum().
Without a CUDA device the kernels run under the Triton interpreter (conftest.py
sets TRITON_INTERPRET=1): shapes stay tiny, T = 70 where two 64-token
checkpoint chunks are needed.
"""

import pytest

from conftest import GRAD_TOL, assert_gradients_match, params, require_triton
from conftest import small_case as small

require_triton()

import torch  # noqa: E402

import deltarule  # noqa: E402
from deltarule import cases  # noqa: E402
from deltarule.backends import triton_backend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.triton


def check(case: dict, dtype: str = "float32"):
    args = cases.make_inputs(case, dtype, DEVICE)
    p = deltarule.validate(**{**args, "q": args["q"].detach().requires_grad_(True)})
    assert p.requires_grad and triton_backend.supports(p) is None
    assert_gradients_match(args, "triton", GRAD_TOL[dtype])


@pytest.mark.parametrize("case", params(
    small(B=2, T=70, K=20, V=12),                                                   # two checkpoint chunks
    small(B=1, T=70, K=100, V=20, decay="gk", update="erase_write"),                # K, V not powers of two
    small(Hq=2, Hk=2, Hv=4, T=12, V=72, decay="g+gk"),                              # GVA; two value tiles
    small(Hq=4, Hk=2, Hv=2, T=12, update="erase_write"),                            # GQA, G = 2
    small(B=1, T=75, cu_seqlens=[0, 30, 30, 75], decay="gk"),                       # an empty sequence
    small(B=2, T=10, seq_lens=[4, 10], initial_state=False),                        # tokens outside every span
    small(B=1, T=12, decay="g+gk", update="erase_write", decay_resets=[3, 7]),      # -inf log decay: resets
    small(T=12, qk_l2norm=True, beta_sigmoid=True, raw_gate=True),                  # Qwen3-Next's preprocessing
    small(B=1, T=12, decay="gk", update="erase_write", raw_gate=True, beta_sigmoid=True, state_layout="vk"),
    small(B=1, T=8, rule="linear", decay="none", update="none"),
    small(B=1, T=8, rule="delta", decay="none", update="beta"),
))
def test_gradients(case, nan_poison):
    check(case)


def test_bfloat16():
    check(small(B=1, T=12, decay="gk", qk_l2norm=True), "bfloat16")


def test_supports_gradients():
    assert "none yet" not in triton_backend.SUPPORTS["gradients"]
