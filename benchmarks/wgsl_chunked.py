"""WGSL prefill: the chunked passes against the fused recurrent shader, same adapter, same run.

    python benchmarks/wgsl_chunked.py                              # B = 1, H = 4, K = V = 64, 1k and 4k
    python benchmarks/wgsl_chunked.py --heads 16 --dim 128 --lengths 1024,4096 --decay gk

Times `linear_attention(..., backend="wgsl")` on a GDN-style layer (scalar g, or per-key gk,
with beta, L2-normalised keys, an initial state) with the dispatcher's threshold forced each way
(`chunked.MIN_TOKENS`), interleaved in rounds (`deltarule.tools.bench.timing.interleaved`), and prints
the median ms per call and the ratio recurrent / chunked with its [min-max] over the rounds.
Inputs are torch tensors on the host: both paths upload them and download o and the state.
The issue's target: chunked >= 3x the recurrence at 4k tokens on the same adapter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..")))

import deltarule  # noqa: E402
from deltarule.tools.bench.timing import interleaved  # noqa: E402
from deltarule.kernels.wgsl import _device, chunked  # noqa: E402


def call(inputs: dict, threshold: int, chunk_size: int):
    def run():
        saved = chunked.MIN_TOKENS
        chunked.MIN_TOKENS = threshold
        try:
            return deltarule.linear_attention(**inputs, backend="wgsl", chunk_size=chunk_size)
        finally:
            chunked.MIN_TOKENS = saved
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64, help="K = V")
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--decay", choices=("g", "gk"), default="g")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    reason = _device.unavailable_reason()
    if reason:
        sys.exit(f"no WebGPU adapter: {reason}")
    print(f"adapter: {_device.gpu().adapter}")
    B, H, D = args.batch, args.heads, args.dim
    print(f"B={B} H={H} K=V={D} decay={args.decay} chunk_size={args.chunk_size} (median ms per call)")
    print(f"{'T':>6} {'recurrent':>10} {'chunked':>10} {'ratio':>7} {'[min-max]':>13}")
    for T in (int(t) for t in args.lengths.split(",")):
        gen = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
        inputs = dict(q=q, k=torch.nn.functional.normalize(k, dim=-1), v=v,
                      beta=torch.rand(B, T, H, generator=gen),
                      initial_state=torch.randn(B, H, D, D, generator=gen) * 0.1)
        if args.decay == "g":
            inputs["g"] = -0.1 * torch.rand(B, T, H, generator=gen)
        else:
            inputs["gk"] = -0.1 * torch.rand(B, T, H, D, generator=gen)
        timings = interleaved({"recurrent": call(inputs, 1 << 62, args.chunk_size),
                               "chunked": call(inputs, 1, args.chunk_size)}, repeat=args.rounds, budget=2.0)
        rec, chk = timings["recurrent"].samples, timings["chunked"].samples
        ratios = [a / b for a, b in zip(rec, chk)]
        print(f"{T:>6} {statistics.median(rec) * 1e3:>10.1f} {statistics.median(chk) * 1e3:>10.1f} "
              f"{statistics.median(ratios):>6.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]", flush=True)


if __name__ == "__main__":
    main()
