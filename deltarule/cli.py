"""The `deltarule` command: check, bench, info."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltarule", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_check = sub.add_parser("check", help="run test.json against the float64 reference")
    from .check import add_arguments as check_args
    check_args(p_check)

    p_bench = sub.add_parser("bench", help="time bench.json cases beside the installed peers")
    from .bench import add_arguments as bench_args
    bench_args(p_bench)

    sub.add_parser("info", help="backends available on this machine and what each supports")

    args = parser.parse_args(argv)
    if args.command == "check":
        from .check import main as check_main
        return check_main(args)
    if args.command == "bench":
        from .bench import main as bench_main
        return bench_main(args)
    return _info()


def _info() -> int:
    import torch

    from . import __version__
    from .backends import info

    print(f"deltarule {__version__}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    for b in info():
        state = "available" if b["available"] else "not available"
        print(f"  {b['name']:<10} {state:<14} {b['description']}")
        if not b["available"]:
            print(f"  {'':<10} {'why:':<14} {b['unavailable']}")
        for feature, what in b["supports"].items():
            print(f"  {'':<10} {feature + ':':<14} {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
