"""Context-parallel prefill: the token axis split across processes.

    torchrun --nproc-per-node 2 examples/context_parallel.py     # or 3, 4, ...

Each rank holds a contiguous slice of three packed sequences (one of them crosses every
rank boundary) and calls `deltarule.distributed.linear_attention` on it; rank 0 checks
the result against one `deltarule.linear_attention` over all the tokens.
"""

import torch
import torch.distributed as dist

import deltarule
import deltarule.distributed


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    # The same global inputs on every rank, for the check; in real use each rank has its slice only.
    gen = torch.Generator().manual_seed(0)
    T, H, K, V = 4096, 4, 64, 64
    cu_seqlens = torch.tensor([0, 700, 3500, T])
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, V, generator=gen)
    g = -torch.rand(1, T, H, generator=gen) * 0.1
    beta = torch.rand(1, T, H, generator=gen)

    lo, hi = rank * T // world, (rank + 1) * T // world           # this rank's slice
    o, state = deltarule.distributed.linear_attention(
        q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g=g[:, lo:hi], beta=beta[:, lo:hi],
        cu_seqlens=cu_seqlens, qk_l2norm=True)

    o_all, state_all = deltarule.linear_attention(q, k, v, g=g, beta=beta, cu_seqlens=cu_seqlens, qk_l2norm=True)
    o_err = ((o - o_all[:, lo:hi]).norm() / o_all[:, lo:hi].norm()).item()
    s_err = ((state - state_all).norm() / state_all.norm()).item()
    errors = [None] * world
    dist.all_gather_object(errors, (lo, hi, o_err, s_err))
    if rank == 0:
        for r, (a, b, eo, es) in enumerate(errors):
            print(f"rank {r}: tokens [{a}, {b}): outputs {eo:.1e}, final states {es:.1e} (relative to one process)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
