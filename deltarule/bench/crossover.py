"""Where short sequences should switch from the recurrence to chunks.

    python -m deltarule.bench.crossover --batch 1 --lengths 1,8,16,32,64,128,256

Times the torch chunked, torch recurrent and cpu (numba) recurrent paths
through `linear_attention` on the 16-head K = V = 128 layer (scalar g + beta,
with an initial state), forcing each path with the backends'
`RECURRENT_MAX_LEN`; prints the median ms per call. The thresholds in
`backends/torch_backend.py` and `backends/cpu_backend.py` come from this table.
"""

from __future__ import annotations

import argparse

import torch

from .. import linear_attention
from ..backends import cpu_backend, torch_backend
from .timing import measure

PATHS = (
    ("torch chunked", "torch", torch_backend, 0),
    ("torch recurrent", "torch", torch_backend, 1 << 30),
    ("cpu recurrent", "cpu", cpu_backend, 1 << 30),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--lengths", default="1,8,16,32,64,128,256")
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args(argv)
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
        for _, backend, module, threshold in PATHS:
            saved = module.RECURRENT_MAX_LEN
            module.RECURRENT_MAX_LEN = threshold
            try:
                timing = measure(lambda: linear_attention(q, k, v, g=g, beta=beta, initial_state=s0,
                                                          backend=backend), repeat=15, budget=2.0)
            finally:
                module.RECURRENT_MAX_LEN = saved
            times.append(timing.median * 1e3)
        print(f"{B:>3} {T:>5}" + "".join(f" {t:16.2f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
