"""Context-parallel prefill: compute and communication of each stage, on 1 or more ranks.

    torchrun --standalone --nproc-per-node 1 benchmarks/context_parallel.py --tokens 65536
    torchrun --standalone --nproc-per-node 2 benchmarks/context_parallel.py --tokens 65536 [--split 2:1]

One thread per rank, gloo, B = 1, one sequence of T tokens (Qwen3-Next's GDN layer: 16
heads, K = V = 128, float32). Times, each the median of --repeat runs:

- "one call": `deltarule.distributed.linear_attention` end to end;
- its stages, timed apart with a barrier between them: the local slice (the pieces that
  start here from their initial state, a continued piece with the K identity columns),
  waiting for the slowest rank, the all-gather of the transitions, the chain and the
  output correction.

With one rank it also times plain `deltarule.linear_attention`. The communication
volume is what each rank receives from the all-gather (and the 3 integers per rank of the
first one). The final state is checked against the one-rank run's, saved by that run
(--state FILE).
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import deltarule
import deltarule.distributed as cp


def inputs(T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, V, generator=gen)
    g = -torch.rand(1, T, H, generator=gen) * 0.1
    beta = torch.rand(1, T, H, generator=gen)
    return q, k, v, g, beta


def median_time(fn, repeat):
    """Median seconds of `repeat` calls after one untimed call, each started after a barrier."""
    dist.barrier()
    fn()
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--split", default="even", help="'even' or ratios such as 2:1 (rank 0 first)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--state", default="/tmp/deltarule_cp_state_{tokens}.pt",
                        help="the one-rank run saves its final state here ({tokens}: --tokens); more ranks "
                             "compare with it")
    args = parser.parse_args()
    args.state = args.state.format(tokens=args.tokens)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    T, H, K = args.tokens, args.heads, args.dim
    weights = [1] * world if args.split == "even" else [float(x) for x in args.split.split(":")]
    assert len(weights) == world, "one ratio per rank"
    bounds = [round(T * sum(weights[:r]) / sum(weights)) for r in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    q, k, v, g, beta = inputs(T, H, K, K)
    q, k, v, g, beta = (x[:, lo:hi].contiguous() for x in (q, k, v, g, beta))
    kw = dict(g=g, beta=beta, qk_l2norm=True, backend="cpu")
    common = dict(rule="gated_delta", scale=None, qk_l2norm=True, l2norm_eps=1e-6, A_log=None, dt_bias=None,
                  beta_sigmoid=False, chunk_size=64, backend="cpu")
    gates = dict(g=g, gk=None, beta=beta, erase=None, write=None)

    results = {}
    with torch.no_grad():
        out = {}
        results["one call"] = median_time(lambda: out.update(r=cp.linear_attention(q, k, v, **kw)), args.repeat)
        o, state = out["r"]
        if world == 1:
            results["linear_attention"] = median_time(lambda: deltarule.linear_attention(q, k, v, **kw), args.repeat)
            torch.save(state, args.state)
        table = cp.pieces([b - a for a, b in zip(bounds, bounds[1:])], None, 1)
        stage = {}
        stage["local slice"] = median_time(
            lambda: stage.update(local=cp._Slice(q, k, v, gates, common, None, table[rank], padded=True)),
            args.repeat)
        local = stage["local"]
        packets = local.packet(max(cp.packet_size(held, H, K, K) for held in table))

        def gather():
            stage["gathered"] = cp._all_gather(packets, None, False)

        # the barrier inside median_time absorbs the wait for the slowest rank's slice; time it apart
        start = time.perf_counter()
        dist.barrier()
        results["wait for the slowest rank"] = time.perf_counter() - start
        results["all-gather"] = median_time(gather, args.repeat)

        def finish():
            incoming, finals = cp._chain(table, stage["gathered"], rank, None, 1, H, K, K, q.device)
            stage["o"] = local.outputs(incoming)

        results["chain + correction"] = median_time(finish, args.repeat)
        results["local slice"] = stage["local slice"]
    volume = world * packets.numel() * packets.element_size() + world * 3 * 8
    state_err = None
    if world > 1:
        reference = torch.load(args.state)
        state_err = ((state - reference).norm() / reference.norm()).item()
    report = [None] * world
    dist.all_gather_object(report, dict(rank=rank, tokens=hi - lo, times=results, volume=volume, err=state_err))
    if rank == 0:
        print(f"T = {T}, {H} heads, K = V = {K}, float32, {world} rank(s) of one thread, gloo, split {bounds}")
        for r in report:
            times = ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in r["times"].items())
            extra = "" if r["err"] is None else f"; final state vs one rank {r['err']:.1e}"
            print(f"rank {r['rank']} ({r['tokens']} tokens): {times}; receives {r['volume']} bytes{extra}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
