"""`deltarule.gate.bounded_gate`: KDA's bounded per-key decay (fla's ``lower_bound`` gate), the one
form the fla drop-ins and the vLLM plugin's Kimi Linear layers pass as ``gk``."""

import pytest
import torch

from deltarule.errors import ContractError
from deltarule.gate import bounded_gate


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 5, 3, 4, generator=g).to(dtype), torch.rand(3, generator=g),
            torch.randn(12, generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_a_log", [True, False])
@pytest.mark.parametrize("with_dt_bias", [True, False])
def test_bounded_gate_matches_float64(dtype, with_a_log, with_dt_bias):
    raw, A_log, dt_bias = _inputs(dtype)
    A_log, dt_bias = (A_log if with_a_log else None), (dt_bias if with_dt_bias else None)
    gk = bounded_gate(raw, -5.0, A_log, dt_bias)
    x = raw.double() + (dt_bias.double().view(3, 4) if dt_bias is not None else 0)
    if A_log is not None:
        x = A_log.double().exp()[:, None] * x
    want = -5.0 * torch.sigmoid(x)
    assert gk.dtype == torch.float32 and gk.shape == raw.shape
    assert (gk.double() - want).abs().max() < 2e-6
    assert (gk < 0).all() and (gk > -5.0).all()


def test_bounded_gate_is_the_fla_drop_ins_gate():
    """fla's chunk_kda with lower_bound forms its gk with this function: the same bits."""
    import deltarule.contracts.fla as dfla
    raw, A_log, dt_bias = _inputs(torch.bfloat16, seed=1)
    got = dfla._vector_gate(raw, A_log, dt_bias, -3.0, use_gate_in_kernel=True, fn="chunk_kda")
    assert got.keys() == {"gk"} and torch.equal(got["gk"], bounded_gate(raw, -3.0, A_log, dt_bias.view(3, 4)))


@pytest.mark.parametrize("args, match", [
    (dict(g=torch.zeros(4)), r"^g: .*rank >= 2"),
    (dict(g=[[0.0]]), r"^g: .*torch.Tensor"),
    (dict(A_log=torch.zeros(4)), r"^A_log: .*3 elements"),
    (dict(dt_bias=torch.zeros(3, 3)), r"^dt_bias: .*12 elements"),
])
def test_bounded_gate_refuses(args, match):
    call = dict(g=torch.zeros(1, 2, 3, 4), lower_bound=-1.0, **{k: v for k, v in args.items() if k != "g"})
    call["g"] = args.get("g", call["g"])
    with pytest.raises(ContractError, match=match):
        bounded_gate(**call)
