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
from deltarule.tools.check import STORE_TOL
from distributed_cases import CASES, DISAGREEMENTS, GRAD_TOL, REFUSALS, TOL

WORLD_SIZES = (2, 3, 4)
WORKER = Path(__file__).with_name("distributed_cases.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"world{w}")
def ranks(request, tmp_path_factory):
    """One world size's run: every rank's {case: result} (the cases it finished), its exit
    status and its output."""
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
    results = [json.loads(path.read_text()) if (path := out / f"rank{r}.json").exists() else {}
               for r in range(world)]
    return dict(results=results, codes=[p.returncode for p in procs], logs=logs)


def _case(ranks, name) -> list[dict]:
    """Every rank's result of case `name`; fails with the processes' output when a rank has none."""
    missing = [r for r, results in enumerate(ranks["results"]) if name not in results]
    if missing:
        pytest.fail(f"rank(s) {missing} have no result for {name!r} (exit status {ranks['codes']}):\n"
                    + "\n".join(log[-3000:] for log in ranks["logs"]))
    return [results[name] for results in ranks["results"]]


def test_every_process_exits_cleanly(ranks):
    assert ranks["codes"] == [0] * len(ranks["codes"]), "\n".join(log[-3000:] for log in ranks["logs"])


@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_process(ranks, name):
    results = _case(ranks, name)
    bad = []
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r['error']}"
        tol = TOL + (STORE_TOL[torch.bfloat16] if r["state_dtype"] == "torch.bfloat16" else 0)
        if not (r["o"] <= TOL and r["state"] <= tol):
            bad.append(f"rank {rank} (slices {r['counts']}): o {r['o']:.1e}, state {r['state']:.1e}")
        for input_name, err in r.get("grads", {}).items():
            if not err <= GRAD_TOL:
                bad.append(f"rank {rank}: d{input_name} {err:.1e}")
    assert not bad, bad
    assert sum(r["o_shape"][1] for r in results) == sum(results[0]["counts"])


@pytest.mark.parametrize("name", REFUSALS)
def test_invalid_arguments_raise_on_every_rank(ranks, name):
    """One rank's bad argument: it names the argument, every other rank names the group."""
    results = _case(ranks, name)
    arguments = [r["argument"] for r in results]
    if name == "bad-beta-on-rank-1":
        assert arguments == ["group", "beta", *["group"] * (len(results) - 2)], arguments
        assert "rank(s) [1]" in results[0]["message"]
    else:
        assert arguments == ["cu_seqlens"] * len(results), arguments


@pytest.mark.parametrize("name", list(DISAGREEMENTS))
def test_disagreeing_ranks_raise_on_every_rank(ranks, name):
    """One rank passes a different argument (valid on its own): every rank raises the same
    ContractError naming the argument and the ranks (none aborts or waits)."""
    results = _case(ranks, name)
    world = len(results)
    argument, _, _, differing = DISAGREEMENTS[name]
    differing %= world
    assert [r["argument"] for r in results] == [argument] * world, [r.get("message") for r in results]
    assert len({r["message"] for r in results}) == 1, results
    others = [r for r in range(world) if r != differing]
    expected = ("rank 1 differs from rank 0" if world == 2
                else f"rank {differing} differs from ranks {', '.join(map(str, others))}")
    assert expected in results[0]["message"], results[0]["message"]


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


def test_initial_state_on_another_device_is_refused_locally():
    """Checked with the other local arguments, before the first collective (it failed later,
    only on the ranks that run a sequence's first token, while the others waited)."""
    import deltarule.distributed as cp
    from distributed_cases import inputs

    args = inputs(dict(cu=[10, 30], gates="gdn", h0="kv"))
    gates = {n: args.get(n) for n in ("g", "gk", "beta", "erase", "write")}
    common = dict(rule=args["rule"], scale=None, qk_l2norm=True, l2norm_eps=1e-6, A_log=None, dt_bias=None,
                  beta_sigmoid=False, chunk_size=64, backend="cpu")
    failure, _ = cp._check_local(args["q"], args["k"], args["v"], gates, common, args["initial_state"].to("meta"),
                                 "kv", args["cu_seqlens"])
    assert failure is not None and failure.argument == "initial_state"
    failure, cu = cp._check_local(args["q"], args["k"], args["v"], gates, common, args["initial_state"], "kv",
                                  args["cu_seqlens"])
    assert failure is None and cu == [0, 10, 40]


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


def test_tensor_hash_is_the_modular_sum_it_documents():
    """`tensor_hash` on the CPU equals its definition in Python integers (torch's int32 products
    and sums wrap, the int64 ones too), over several chunks and a tail, for 32- and 16-bit words."""
    import deltarule.distributed as cp

    def wrap(x, bits):
        x &= (1 << bits) - 1
        return x - (1 << bits) if x >= 1 << (bits - 1) else x

    def defined(x):
        words = x.contiguous().view(-1).view(torch.int32 if x.element_size() == 4 else torch.int16).tolist()
        a = cp._weights(2 * cp._WORDS, b"words", "i").view(2, -1).tolist()
        chunks = len(words) // cp._WORDS + 1
        b = cp._weights(chunks, b"chunks", "q").tolist()
        total = 0
        for c in range(chunks):
            part = words[c * cp._WORDS:(c + 1) * cp._WORDS]
            low = sum(w * a[0][i] for i, w in enumerate(part)) % (1 << 32)
            high = wrap(sum(w * a[1][i] for i, w in enumerate(part)), 32)
            total += (high * (1 << 32) + low) * b[c]
        return wrap(total, 64)

    gen = torch.Generator().manual_seed(3)
    for x in (torch.randn(2, 70001, generator=gen), torch.randn(5 * 65536 + 3, generator=gen).bfloat16(),
              torch.randn(7, generator=gen).half()):
        assert int(cp.tensor_hash(x)) == defined(x), x.dtype


def test_value_hash_sees_every_bit_and_not_the_layout():
    """One flipped bit anywhere changes the hash (host and device paths); the same values in a
    non-contiguous tensor do not. (That every process gets the same hashes, with Python's
    per-process salt of str hashes, the gloo cases show: their ranks' digests agree.)"""
    import deltarule.distributed as cp

    gen = torch.Generator().manual_seed(5)
    for x in (torch.randn(3, 4, 16, 12, generator=gen), torch.randn(2, 4, 64, 128, generator=gen),
              torch.randn(2, 4, 64, 128, generator=gen).bfloat16()):
        bits = x.view(torch.int32 if x.element_size() == 4 else torch.int16)
        base = int(cp._value_hash(x))
        for index in torch.randint(0, x.numel(), (4,), generator=gen).tolist():
            for bit in (0, 8 * x.element_size() - 1):
                y = bits.clone().view(-1)
                y[index] ^= torch.tensor(1 << bit if bit < 8 * x.element_size() - 1 else -(1 << bit),
                                         dtype=y.dtype)
                assert int(cp._value_hash(y.view(bits.shape).view(x.dtype))) != base, (x.shape, index, bit)
        assert int(cp._value_hash(x.transpose(-1, -2).contiguous().transpose(-1, -2))) == base
