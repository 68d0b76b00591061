"""Where short sequences should switch from the recurrence to chunks, and
which chunk size the CPU prefers.

    python -m deltarule.tools.bench.crossover --batch 1 --lengths 1,8,16,32,64,128,256
    python -m deltarule.tools.bench.crossover --chunk-sizes 32,64 --case qwen3-next-16h-prefill-4k
    python -m deltarule.tools.bench.crossover --scaling 1024,4096,32768 --case qwen3-next-16h-prefill-4k

Times the torch backend's chunked and recurrent paths (forced with its
`RECURRENT_MAX_LEN`) and the cpu backend's native recurrence through
`linear_attention` on the 16-head K = V = 128 layer (scalar g + beta, with an
initial state); prints the median ms per call. The torch backend's threshold
comes from this table, and it shows that the cpu backend needs none.
With --chunk-sizes, times the torch backend's chunked kernel on bench.json
cases at each chunk size, interleaved in one process. With --scaling, times one case (default backend)
at several T and prints µs per token and the growth of the process's peak RSS
over a call at each T (run the largest T first in a fresh process for a clean
peak).
"""

from __future__ import annotations

import argparse
import resource

import torch

from ... import linear_attention
from ...backends import torch_backend
from ...cases import bench_cases, make_inputs
from .timing import measure

# (label, backend, the torch backend's RECURRENT_MAX_LEN for the run or None)
PATHS = (
    ("torch chunked", "torch", 0),
    ("torch recurrent", "torch", 1 << 30),
    ("cpu", "cpu", None),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--lengths", default="1,8,16,32,64,128,256")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--chunk-sizes", help="compare these chunk sizes instead (e.g. 32,64)")
    parser.add_argument("--scaling", help="sequence lengths for the scaling table (e.g. 1024,4096,32768)")
    parser.add_argument("--case", action="append", help="bench.json case for --chunk-sizes / --scaling")
    args = parser.parse_args(argv)
    if args.scaling:
        scaling([int(t) for t in args.scaling.split(",")], (args.case or ["qwen3-next-16h-prefill-4k"])[0])
        return
    if args.chunk_sizes:
        chunk_sizes([int(c) for c in args.chunk_sizes.split(",")], args.case or ["qwen3-next-16h-prefill-4k"])
        return
    B, H, K, V = args.batch, args.heads, 128, 128
    print(f"{'B':>3} {'T':>5}" + "".join(f" {name:>16}" for name, *_ in PATHS) + "   (median ms)")
    for T in (int(t) for t in args.lengths.split(",")):
        gen = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(B, T, H, d, generator=gen) for d in (K, K, V))
        k = torch.nn.functional.normalize(k, dim=-1)
        g = -0.1 * torch.rand(B, T, H, generator=gen)
        beta = torch.rand(B, T, H, generator=gen)
        s0 = torch.randn(B, H, K, V, generator=gen)
        times = []
        for _, backend, threshold in PATHS:
            saved = torch_backend.set_recurrent_max_len(
                torch_backend.RECURRENT_MAX_LEN if threshold is None else threshold)
            try:
                timing = measure(lambda: linear_attention(q, k, v, g=g, beta=beta, initial_state=s0,
                                                          backend=backend), repeat=15, budget=2.0)
            finally:
                torch_backend.set_recurrent_max_len(saved)
            times.append(timing.median * 1e3)
        print(f"{B:>3} {T:>5}" + "".join(f" {t:16.2f}" for t in times), flush=True)


def chunk_sizes(sizes: list[int], names: list[str], rounds: int = 5) -> None:
    """Median ms of the torch backend per chunk size, rounds interleaved."""
    for name in names:
        case = next(c for c in bench_cases() if c["name"] == name)
        inputs = make_inputs(case)
        samples = {c: [] for c in sizes}
        for _ in range(rounds):
            for c in sizes:
                samples[c].append(measure(lambda: linear_attention(**dict(inputs, chunk_size=c), backend="torch"),
                                          repeat=1, budget=0.0).median)
        print(name, "  ".join(f"C={c}: {sorted(s)[len(s) // 2] * 1e3:.0f} ms" for c, s in samples.items()),
              flush=True)


def scaling(lengths: list[int], name: str) -> None:
    """µs per token and peak-RSS growth per call of one case at several T."""
    case = next(c for c in bench_cases() if c["name"] == name)
    print(f"{name}: T, median ms, µs/token, inputs MiB, outputs MiB, peak RSS growth MiB")
    for T in lengths:
        inputs = make_inputs(dict(case, T=T))
        in_mib = sum(x.numel() * x.element_size() for x in inputs.values() if isinstance(x, torch.Tensor)) / 2**20
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        o, state = linear_attention(**inputs)
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        out_mib = (o.numel() * o.element_size() + state.numel() * state.element_size()) / 2**20
        del o, state
        timing = measure(lambda: linear_attention(**inputs), repeat=3, budget=5.0)
        print(f"{T:>7} {timing.median * 1e3:10.1f} {timing.median / T * 1e6:10.1f} {in_mib:10.0f} "
              f"{out_mib:10.0f} {grown:10.0f}", flush=True)


if __name__ == "__main__":
    main()
