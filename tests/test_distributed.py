"""deltarule.distributed.linear_attention over gloo: 2, 3 and 4 processes on this machine.

Each world size starts its processes once (tests/distributed_cases.py) and runs every
case there; each case here checks every rank's slice of the outputs, the final states
and (grad cases) the gradients against one `deltarule.linear_attention` over all the
tokens. Sequences cross rank boundaries in every case; the "ragged" splits leave rank 1
without tokens (with 2 ranks: a quarter and three quarters).
"""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deltarule
from deltarule.check import STORE_TOL
from distributed_cases import CASES, GRAD_TOL, REFUSALS, TOL

WORLD_SIZES = (2, 3, 4)
WORKER = Path(__file__).with_name("distributed_cases.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def ranks(request, tmp_path_factory):
    """Every rank's results, {case: result} per rank, for one world size."""
    world = request.param
    out = tmp_path_factory.mktemp(f"world{world}")
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(port), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"world {world}: the gloo processes did not finish")
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_process(ranks, name):
    bad = []
    for rank, results in enumerate(ranks):
        r = results[name]
        assert "error" not in r, f"rank {rank}: {r['error']}"
        tol = TOL + (STORE_TOL[torch.bfloat16] if r["state_dtype"] == "torch.bfloat16" else 0)
        if not (r["o"] <= TOL and r["state"] <= tol):
            bad.append(f"rank {rank} (slices {r['counts']}): o {r['o']:.1e}, state {r['state']:.1e}")
        for input_name, err in r.get("grads", {}).items():
            if not err <= GRAD_TOL:
                bad.append(f"rank {rank}: d{input_name} {err:.1e}")
    assert not bad, bad
    assert sum(r[name]["o_shape"][1] for r in ranks) == sum(ranks[0][name]["counts"])


@pytest.mark.parametrize("name", REFUSALS)
def test_invalid_arguments_raise_on_every_rank(ranks, name):
    """One rank's bad argument: it names the argument, every other rank names the group."""
    arguments = [results[name]["argument"] for results in ranks]
    if name == "bad-beta-on-rank-1":
        assert arguments == ["group", "beta", *["group"] * (len(ranks) - 2)], arguments
        assert "rank(s) [1]" in ranks[0][name]["message"]
    else:
        assert arguments == ["cu_seqlens"] * len(ranks), arguments


def test_torchrun_example(tmp_path):
    example = Path(__file__).parents[1] / "examples" / "context_parallel.py"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(example)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2
    for line in lines:
        errors = [float(x) for x in re.findall(r"\d\.\de[-+]\d+", line)]
        assert len(errors) == 2 and all(e <= 1e-5 for e in errors), line


def test_refuses_without_process_group():
    import deltarule.distributed

    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(deltarule.ContractError, match="group"):
        deltarule.distributed.linear_attention(q, q, q)


@pytest.mark.parametrize("gates", ["gdn", "kda", "gdn2", "linear"])
def test_transition_of_a_slice(gates):
    """The stage every rank runs, without processes: the identity columns end as
    M = prod_t (I - k_t (b_t * k_t)^T) D_t (checked against that product in float64), the
    others as X, and the corrected outputs equal a run from the incoming state."""
    from distributed_cases import inputs

    import deltarule.distributed as cp

    args = inputs(dict(B=1, T=37, gates=gates))
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    gate_args = {n: args.pop(n, None) for n in ("g", "gk", "beta", "erase", "write")}
    common = dict(rule=args.pop("rule"), scale=None, qk_l2norm=args.pop("qk_l2norm", False), l2norm_eps=1e-6,
                  A_log=None, dt_bias=None, beta_sigmoid=False, chunk_size=64, backend="cpu")
    piece = cp.Piece(0, 0, 37, continued=True)
    local = cp._Slice(q, k, v, gate_args, common, None, [piece], padded=True)
    Hv, K, V = v.shape[2], k.shape[3], v.shape[3]
    M, X = local.aug_final[0, ..., :K], local.aug_final[0, ..., K:]

    kn = k.double().repeat_interleave(Hv // k.shape[2], dim=2)[0]
    if common["qk_l2norm"]:
        kn = kn / torch.sqrt((kn * kn).sum(-1, keepdim=True) + 1e-6)
    decay = torch.zeros(37, Hv, K, dtype=torch.float64)
    for name in ("g", "gk"):
        if gate_args[name] is not None:
            decay = decay + (gate_args[name][0].double()[..., None] if name == "g" else gate_args[name][0].double())
    erase = (gate_args["beta"][0].double()[..., None].expand(37, Hv, K) if gate_args["beta"] is not None
             else gate_args["erase"][0].double() if gate_args["erase"] is not None else torch.zeros(37, Hv, K,
                                                                                                  dtype=torch.float64))
    product = torch.eye(K, dtype=torch.float64).expand(Hv, K, K)
    for t in range(37):
        step = torch.diag_embed(decay[t].exp())
        step = step - torch.einsum("hi,hj->hij", kn[t], erase[t] * kn[t]) @ step
        product = step @ product
    assert (M.double() - product).norm() / product.norm() <= 1e-5

    S_in = torch.randn(1, Hv, K, V, generator=torch.Generator().manual_seed(4))
    o = local.outputs(S_in)
    ref_o, ref_state = deltarule.linear_attention(q, k, v, **gate_args, **common, initial_state=S_in)
    assert (o - ref_o).norm() / ref_o.norm() <= 1e-5
    chained = torch.einsum("hij,hjv->hiv", M, S_in[0]) + X
    assert (chained - ref_state[0]).norm() / ref_state[0].norm() <= 1e-5
