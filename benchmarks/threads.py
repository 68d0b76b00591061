"""The cpu kernel's threads: torch's OpenMP pool against the kernel's own, with a torch GEMM
before every call (as a model's layers alternate them) and without.

    .venv/bin/python benchmarks/threads.py [--rounds 5]

Cases at Qwen3.5-0.8B's layer shape (16 heads, K = V = 128, bfloat16 q / k / v, raw decay
and beta gates, qk L2 norm): decode B = 1 and 8 on a float32 slab of 400 rows, prefill of
256 tokens at B = 1 and 8. The GEMM: [8, 1024] x [1024, 4096] bfloat16 before a decode call
(a layer's projection at decode), [B * T, 1024] x [1024, 4096] before a prefill call. Per
round, each kind of threads (`cpu_recurrent.use_threads`) in turn (order alternating): the
mean time of n (GEMM +) call iterations after 3 warm-ups. Ratios own / openmp (> 1: torch's
pool faster) are medians over the rounds, [min-max].
"""

import argparse
import statistics
import time

import torch

import deltarule
from deltarule.tools.bench import copy_bandwidth
from deltarule.kernels.cpu import recurrent as cpu_recurrent

H, K, V, SLOTS = 16, 128, 128, 400
CASES = [("decode", 1, 1, 2000), ("decode", 8, 1, 1000), ("prefill", 1, 256, 40), ("prefill", 8, 256, 6)]


def _case(B: int, T: int, gemm: bool):
    """A no-argument callable: one (GEMM +) deltarule call of the case."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, d, generator=g).bfloat16() for d in (K, K, V))
    a, b = torch.randn(B, T, H, generator=g).bfloat16(), torch.randn(B, T, H, generator=g).bfloat16()
    A_log, dt_bias = torch.rand(H, generator=g), torch.randn(H, generator=g)
    gates = dict(g=a, beta=b, A_log=A_log, dt_bias=dt_bias, beta_sigmoid=True, qk_l2norm=True)
    if T == 1:
        gates.update(initial_state=torch.zeros(SLOTS, H, K, V), state_indices=torch.arange(B) * 37 % SLOTS)
    weight = torch.randn(4096, 1024, generator=g).bfloat16()
    x = torch.randn(8 if T == 1 else B * T, 1024, generator=g).bfloat16()

    def step():
        if gemm:
            torch.nn.functional.linear(x, weight)
        deltarule.linear_attention(q, k, v, backend="cpu", **gates)
    return step


def _time(step, n: int) -> float:
    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    was = cpu_recurrent.threads_in_use()
    if cpu_recurrent.use_threads("openmp") != "openmp":
        print("torch has no OpenMP runtime here: nothing to compare")
        return 1
    print(f"copy bandwidth {copy_bandwidth():.3g} GB/s; torch threads {torch.get_num_threads()}")
    print("| case | B | GEMM before | own threads | torch's OpenMP pool | own / openmp |")
    print("|---|---|---|---|---|---|")
    try:
        for gemm in (True, False):
            for name, B, T, n in CASES:
                step = _case(B, T, gemm)
                times = {"own": [], "openmp": []}
                for r in range(args.rounds):
                    for kind in ("own", "openmp") if r % 2 == 0 else ("openmp", "own"):
                        cpu_recurrent.use_threads(kind)
                        times[kind].append(_time(step, n))
                ratios = [x / y for x, y in zip(times["own"], times["openmp"])]
                print(f"| {name} | {B} | {'yes' if gemm else 'no'} | {1e6 * statistics.median(times['own']):.0f} us | "
                      f"{1e6 * statistics.median(times['openmp']):.0f} us | {statistics.median(ratios):.2f}x "
                      f"[{min(ratios):.2f}-{max(ratios):.2f}] |", flush=True)
    finally:
        cpu_recurrent.use_threads(was)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
