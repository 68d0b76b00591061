"""The `deltarule` command: check, bench, info, card export, export onnx."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import ContractError, Unsupported, one_line

# `deltarule export onnx`'s names (deltarule.onnx.export.graph.TARGETS, deltarule.onnx.export.quantize's
# DTYPES and ALIASES; kept here so the command line parses without importing onnx; a test
# compares them)
EXPORT_TARGETS = ("ort", "onnx", "ort-gpu")
EXPORT_DTYPES = ("fp32", "fp16", "q8", "q4", "q4f16", "float32", "float16")

# The user errors a command reports as one line on stderr with exit status 2: a bad
# argument (`ContractError`, also an output path that cannot be written,
# `deltarule.tools.paths`) or a valid request deltarule declines (`Unsupported`). Anything else
# is a bug and keeps its traceback.
USER_ERRORS = (ContractError, Unsupported)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; its exit status (2: a usage or user error, one line on stderr)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return _run(args, parser)
    except USER_ERRORS as error:
        return user_error(_command(args), error)


def user_error(command: str, error: BaseException) -> int:
    """Print `error` as the one line ``deltarule <command>: <message>`` on stderr; returns 2."""
    message = one_line(error)
    print(f"deltarule {command}: {message or type(error).__name__}", file=sys.stderr, flush=True)
    return 2


def _command(args: argparse.Namespace) -> str:
    """The subcommand's words: check, bench, info, card export, export onnx."""
    sub = {"card": "card_command", "export": "export_command"}.get(args.command)
    return f"{args.command} {getattr(args, sub)}" if sub else args.command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltarule", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_check = sub.add_parser("check", help="run test.json against the float64 reference")
    from .check import add_arguments as check_args
    check_args(p_check)

    p_bench = sub.add_parser("bench", help="time bench.json cases beside the installed peers")
    from .bench import add_arguments as bench_args
    bench_args(p_bench)

    sub.add_parser("info", help="backends available on this machine and what each supports")

    p_card = sub.add_parser("card", help="WebGPU kernel cards of the WGSL shaders (docs/web.md)")
    card_sub = p_card.add_subparsers(dest="card_command", required=True)
    p_export = card_sub.add_parser("export", help="write the cards' folders under DIR")
    p_export.add_argument("directory", metavar="DIR")
    p_export.add_argument("--only", action="append", metavar="ID",
                          help="a card id (com.microsoft.GatedDeltaNet, com.microsoft.LinearAttentionGate, "
                               "deltarule.LinearAttention); repeatable; default all")

    p_model = sub.add_parser("export", help="a transformers hybrid checkpoint as ONNX (docs/export.md)")
    model_sub = p_model.add_subparsers(dest="export_command", required=True)
    p_onnx = model_sub.add_parser("onnx", help="write MODEL_DIR's decoder with fused linear-attention nodes to OUT_DIR")
    p_onnx.add_argument("model_dir", metavar="MODEL_DIR", help="a local checkpoint folder")
    p_onnx.add_argument("out_dir", metavar="OUT_DIR")
    p_onnx.add_argument("--target", default="ort", choices=EXPORT_TARGETS,
                        help="the linear-attention node (docs/export.md): ort (default): com.microsoft."
                             "LinearAttention, ONNX Runtime's CPU form; ort-gpu: com.microsoft.GatedDeltaNet, "
                             "its CUDA / WebGPU form; onnx: the opset-27 standard ops")
    p_onnx.add_argument("--dtype", action="append", metavar="DTYPE", choices=EXPORT_DTYPES,
                        help="transformers.js's dtype names: fp32 (default), fp16, q8, q4, q4f16 (float32 / "
                             "float16 also taken); repeatable: each to the file transformers.js loads for it")
    p_onnx.add_argument("--block-size", type=int, help="q8 / q4 / q4f16: weights per scale (default 32)")
    p_onnx.add_argument("--asymmetric", action="store_true", help="q8 / q4 / q4f16: a zero point per block")
    p_onnx.add_argument("--accuracy-level", type=int,
                        help="q8 / q4 / q4f16: MatMulNBits' accuracy_level, 0-4 (default 4: int8 compute)")
    p_onnx.add_argument("--float-embeddings", action="store_true",
                        help="q4 / q4f16: keep the embedding table float (default: 4-bit GatherBlockQuantized)")
    p_onnx.add_argument("--num-logits-to-keep", action="store_true",
                        help="the decoder takes num_logits_to_keep (transformers.js feeds it) and computes only "
                             "those rows of logits; onnxruntime-genai does not run it")
    p_onnx.add_argument("--overwrite", action="store_true",
                        help="export into a folder that is not empty: what an export writes there is removed first")
    return parser


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.command == "export":
        return _export(args)
    if args.command == "check":
        from .check import main as check_main
        return check_main(args)
    if args.command == "bench":
        from .bench import main as bench_main
        return bench_main(args)
    if args.command == "card":
        from ..cards import CARDS, export
        from .paths import writable_folder
        unknown = sorted(set(args.only or ()) - set(CARDS))
        if unknown:
            parser.error(f"--only: unknown card {unknown[0]!r} (one of {', '.join(CARDS)})")
        writable_folder("DIR", args.directory)
        for folder in export(args.directory, args.only):
            print(folder)
        return 0
    return _info()


def _export(args) -> int:
    from ..onnx.export import export_model
    from .paths import writable_folder

    writable_folder("OUT_DIR", args.out_dir)
    result = export_model(args.model_dir, args.out_dir, target=args.target, dtype=args.dtype or "fp32",
                  quantization=_quantization(args), num_logits_to_keep=args.num_logits_to_keep,
                  overwrite=args.overwrite)
    fused = {f"{d or 'onnx'}.{op}": n for (d, op), n in sorted(result.ops.items()) if op in
             ("LinearAttention", "CausalConvWithState", "GatedDeltaNet")}
    print(f"{result.directory}  ({result.layout.model_type}, target {result.target}; "
          + ", ".join(f"{n} {op}" for op, n in fused.items()) + ")")
    for dtype, files in result.models.items():
        left = result.quantized[dtype].left_float if dtype in result.quantized else ()
        note = f"  ({len(left)} weights left float: Exported.quantized)" if left else ""
        print(f"  {dtype}: " + ", ".join(os.path.relpath(path, result.directory) for path in files.values()) + note)
    if result.genai_model:
        print(f"  genai_config.json loads {result.genai_model}")
    if result.no_genai_config:
        print(f"no genai_config.json: {result.no_genai_config}")
    return 0


def _quantization(args):
    """The quantization options given (None: none was)."""
    if args.block_size is None and args.accuracy_level is None and not args.asymmetric and not args.float_embeddings:
        return None
    from ..onnx.export import Quantization
    defaults = Quantization()
    return Quantization(block_size=defaults.block_size if args.block_size is None else args.block_size,
                        symmetric=not args.asymmetric, embeddings=not args.float_embeddings,
                        accuracy_level=defaults.accuracy_level if args.accuracy_level is None else args.accuracy_level)


def _info() -> int:
    import torch

    from .. import __version__
    from ..backends import info
    from .versions import TESTED, installed

    print(f"deltarule {__version__}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    print("libraries (installed; tested releases):")
    for name, distribution, version, tested in installed():
        state = "not installed" if version is None else f"{distribution} {version}"
        verdict = "" if version is None else ("tested" if tested else "NOT a tested release")
        print(f"  {name:<13} {state:<24} {verdict:<21} tested: {', '.join(TESTED[name])}")
    print("backends:")
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
