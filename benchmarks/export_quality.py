"""Quality of deltarule's ONNX exports at each dtype, and of onnxruntime-genai's int4 builder,
on a trained checkpoint (`benchmarks/train_checkpoint.py`: random weights say nothing about
quantization), against transformers' fp32 eager model (docs/export.md, "Quality of the
quantized exports").

Rows: transformers fp32 (``attn_implementation="eager"``, its linear-attention layers on
transformers' own PyTorch path: deltarule not bound), deltarule's exports at each of `DTYPES`
(`deltarule.onnx.export.export_model`), q4 at the other quantization settings of `VARIANTS`
(`deltarule.onnx.export.Quantization`), onnxruntime-genai's builder ``-p int4 -e cpu`` and ``-p fp32 -e cpu``
(the control) on the same checkpoint (``.venv-genai``: the config adaptation of
`benchmarks/onnx_models.genai_builder`, run there). Every ONNX file runs in onnxruntime (CPU)
through `deltarule.onnx.export.generate.DecoderSession`; logits are compared in float64.

Columns:
- bytes: the .onnx file and its external data (transformers: model.safetensors);
- perplexity: exp of the mean next-token loss, teacher-forced, over `--window`-token windows
  of the validation split (all its non-overlapping ones, or `--windows` spread evenly; each one
  full-sequence prefill from zero state, 8 windows a batch);
- ratio: that perplexity over the transformers fp32 row's;
- greedy agreement: `--prompts` prompts of `--prompt-length` validation tokens (`data`),
  `--new` greedy tokens each (the ONNX files through `DecoderSession.greedy`: prefill, then one
  token a step with the present state fed back; transformers recomputing the whole sequence
  each step): the length of the prefix equal to transformers' tokens over `--new`,
  averaged over the prompts; and how many prompts agree all the way;
- top-1: the fraction of the windows' positions whose argmax equals transformers' argmax.

    .venv/bin/python benchmarks/export_quality.py        # trains the checkpoint first if absent
    .venv/bin/python benchmarks/export_quality.py --steps 600 --threads 1   # reproducible (steps, not seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_checkpoint  # noqa: E402

ROOT = train_checkpoint.ROOT
# deltarule's export dtypes measured, in row order (the exporter's names)
DTYPES = ("fp32", "fp16", "q8", "q4", "q4f16")
# q4 exports with other quantization settings (`deltarule.onnx.export.Quantization` fields; the
# default: blocks of 32, symmetric, accuracy level 4, embeddings quantized), when the exporter has them
VARIANTS = {"q4, block 16": dict(block_size=16), "q4, asymmetric": dict(symmetric=False),
            "q4, block 16, asymmetric": dict(block_size=16, symmetric=False),
            "q4, accuracy level 0": dict(accuracy_level=0), "q4, float embeddings": dict(embeddings=False)}
# onnxruntime-genai builder precisions measured (-p), in row order
GENAI_PRECISIONS = ("int4", "fp32")
GENAI_PYTHON = os.path.join(ROOT, ".venv-genai", "bin", "python")
REFERENCE = "transformers fp32 (eager)"


def onnx_bytes(path: str) -> int:
    """The size of an ONNX file with its external data files."""
    import onnx
    model = onnx.load(path, load_external_data=False)
    locations = set()
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            locations |= {e.value for e in tensor.external_data if e.key == "location"}
    return os.path.getsize(path) + sum(os.path.getsize(os.path.join(os.path.dirname(path), loc)) for loc in locations)


def deltarule_exports(checkpoint: str, root: str, *, reuse: bool = False) -> tuple[dict, dict]:
    """deltarule's export of `checkpoint` at each of `DTYPES`, then q4 at each of `VARIANTS`:
    ({row name: model path}, {row name: why it is missing})."""
    from deltarule.onnx.export import exporter
    from deltarule.onnx.export import export_model as export_onnx
    rows, missing = {}, {}

    def export(out: str, dtypes: list, name: str, **quantization) -> dict:
        record = os.path.join(out, "exported.json")
        if reuse and os.path.isfile(record):
            with open(record) as f:
                paths = json.load(f)
            if all(d in paths and os.path.isfile(paths[d]) for d in dtypes):
                return paths
        start = time.perf_counter()
        options = {"quantization": exporter.Quantization(**quantization)} if quantization else {}
        result = export_onnx(checkpoint, out, dtype=dtypes, overwrite=True, **options)
        print(f"deltarule export {name}: {time.perf_counter() - start:.0f} s", flush=True)
        paths = {d: result.models[d]["model"] for d in dtypes}
        with open(record, "w") as f:
            json.dump(paths, f, indent=2)
        return paths

    paths = export(os.path.join(root, "deltarule"), list(DTYPES), ", ".join(DTYPES))
    rows.update({f"deltarule {d}": paths[d] for d in DTYPES})
    for i, (name, quantization) in enumerate(VARIANTS.items()):
        try:
            rows[f"deltarule {name}"] = export(os.path.join(root, f"deltarule-variant{i}"), ["q4"], name,
                                               **quantization)["q4"]
        except TypeError as error:                     # an exporter without these Quantization fields
            missing[f"deltarule {name}"] = f"{type(error).__name__}: {error}"
    return rows, missing


def genai_exports(checkpoint: str, root: str, *, reuse: bool = False) -> tuple[dict, dict]:
    """onnxruntime-genai's builder on `checkpoint` at each of `GENAI_PRECISIONS`, run by
    ``.venv-genai``'s Python: fp32 through `onnx_models.genai_builder` (which adapts the config
    for the builder into ``genai-fp32/checkpoint``), the others on that adapted folder.
    Returns ({row name: model path}, {row name: why it is missing})."""
    if not os.path.isfile(GENAI_PYTHON):
        why = f"{GENAI_PYTHON} absent (bash .ci/genai install)"
        return {}, {f"genai {p}": why for p in GENAI_PRECISIONS}
    rows, missing = {}, {}
    fp32 = os.path.join(root, "genai-fp32")
    if not reuse and os.path.isdir(fp32):
        import shutil
        shutil.rmtree(fp32)
    start = time.perf_counter()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from onnx_models import genai_builder; "
            "sys.exit(genai_builder(sys.argv[2], sys.argv[3]) is None)")
    run = subprocess.run([GENAI_PYTHON, "-c", code, HERE, os.path.abspath(checkpoint), os.path.abspath(fp32)],
                         cwd=ROOT, capture_output=True, text=True)
    if run.returncode:
        why = f"genai builder fp32 failed: {(run.stderr or run.stdout).strip().splitlines()[-1:]}"
        return {}, {f"genai {p}": why for p in GENAI_PRECISIONS}
    print(f"genai builder fp32: {time.perf_counter() - start:.0f} s", flush=True)
    adapted = os.path.join(fp32, "checkpoint")
    for precision in GENAI_PRECISIONS:
        out = fp32 if precision == "fp32" else os.path.join(root, f"genai-{precision}")
        path = os.path.join(out, "model.onnx")
        if precision != "fp32" and not (reuse and os.path.isfile(path)):
            start = time.perf_counter()
            run = subprocess.run([GENAI_PYTHON, "-m", "onnxruntime_genai.models.builder", "-i", adapted, "-o", out,
                                  "-p", precision, "-e", "cpu", "-c", os.path.join(out, "cache")],
                                 cwd=ROOT, capture_output=True, text=True)
            if run.returncode:
                last = (run.stderr or run.stdout).strip().splitlines()[-1:]
                missing[f"genai {precision}"] = f"builder failed: {last}"
                continue
            print(f"genai builder {precision}: {time.perf_counter() - start:.0f} s", flush=True)
        rows[f"genai {precision}"] = path
    return rows, missing


def _nll(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Next-token losses (float64) [B, T - 1] of logits [B, T, V] for ids [B, T]."""
    x = logits[:, :-1].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logz = np.log(np.exp(x).sum(-1))
    return logz - np.take_along_axis(x, ids[:, 1:, None], -1)[..., 0]


class Reference:
    """transformers' fp32 eager model (deltarule not bound)."""

    def __init__(self, checkpoint: str):
        import torch
        import transformers

        from deltarule.integrations import transformers as integration
        integration.disable()
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32, attn_implementation="eager").eval()

    def logits(self, ids: np.ndarray) -> np.ndarray:
        with self.torch.no_grad():
            return self.model(input_ids=self.torch.from_numpy(ids)).logits.numpy()

    def greedy(self, prompt: np.ndarray, new: int) -> np.ndarray:
        ids = prompt
        for _ in range(new):
            ids = np.concatenate([ids, self.logits(ids)[:, -1].argmax(-1)[:, None]], axis=1)
        return ids[:, prompt.shape[1]:]


class Onnx:
    """An ONNX decoder in onnxruntime (CPU) through `DecoderSession`."""

    def __init__(self, path: str, sizes: dict | None = None, threads: int | None = None):
        from deltarule.onnx.export.generate import DecoderSession
        self.session = DecoderSession(path, sizes=sizes, threads=threads)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        s = self.session
        return s.step(ids, np.ones(ids.shape, np.int64), s.zero_state(ids.shape[0]))[0]

    def greedy(self, prompt: np.ndarray, new: int) -> np.ndarray:
        return self.session.greedy(prompt, new)


def data(checkpoint: str, windows: int, window: int, prompts: int,
         prompt_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(windows [windows, window], prompts [prompts, prompt_length]) of the checkpoint's
    validation split (as it was held out: `train_checkpoint.saved_corpus`): the windows spread
    evenly over it (0: all its non-overlapping windows), the prompts too, half a window later."""
    _, val = train_checkpoint.saved_corpus(checkpoint)
    if windows:
        starts = np.linspace(0, len(val) - window, windows).round().astype(int)
    else:
        starts = np.arange(len(val) // window) * window
    prompt_starts = np.linspace(window // 2, len(val) - window // 2 - prompt_length, prompts).round().astype(int)
    return (np.stack([val[s:s + window] for s in starts]),
            np.stack([val[s:s + prompt_length] for s in prompt_starts]))


def measure(model, windows: np.ndarray, prompts: np.ndarray, new: int, ref: dict | None, batch: int = 8) -> dict:
    """Perplexity, argmax and greedy tokens of `model` (the windows `batch` at a time), and its
    agreement with `ref` (the reference's measurement; None: this is the reference)."""
    start = time.perf_counter()
    nll, top1, error, logits = [], [], 0.0, []
    for i in range(0, len(windows), batch):
        x = model.logits(windows[i:i + batch]).astype(np.float64)
        nll.append(_nll(x, windows[i:i + batch]))
        top1.append(x.argmax(-1))
        if ref is None:
            logits.append(x)
        else:
            error = max(error, float(np.abs(x - ref["logits"][i:i + batch]).max()))
    nll, top1 = np.concatenate(nll), np.concatenate(top1)
    greedy = model.greedy(prompts, new)
    row = dict(perplexity=float(math.exp(nll.mean())), top1=top1, greedy=greedy)
    if ref is not None:
        same = greedy == ref["greedy"]
        prefix = np.where(same.all(1), new, (~same).argmax(1))
        row.update(ratio=row["perplexity"] / ref["perplexity"], greedy_agreement=float(prefix.mean() / new),
                   greedy_identical=int(same.all(1).sum()), top1_agreement=float((top1 == ref["top1"]).mean()),
                   max_logit_error=error)
    else:
        row.update(ratio=1.0, greedy_agreement=1.0, greedy_identical=len(prompts), top1_agreement=1.0,
                   max_logit_error=0.0, logits=np.concatenate(logits))
    row["seconds"] = time.perf_counter() - start
    return row


def table(rows: dict, sizes: dict, missing: dict, prompts: int) -> str:
    lines = ["| file | bytes | perplexity | ratio to fp32 | greedy agreement (identical) | teacher-forced top-1 "
             "| max logit error |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {sizes.get(name, '-'):,} | {r['perplexity']:.3f} | {r['ratio']:.4f} | "
                     f"{r['greedy_agreement']:.3f} ({r['greedy_identical']}/{prompts}) | {r['top1_agreement']:.4f} "
                     f"| {r['max_logit_error']:.2e} |" if name in sizes else
                     f"| {name} | - | {r['perplexity']:.3f} | {r['ratio']:.4f} | - | - | - |")
    for name, why in missing.items():
        lines.append(f"| {name} | not measured: {why} | | | | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=os.path.join(ROOT, ".onnx-models", "quality"))
    parser.add_argument("--checkpoint", help="default: WORKDIR/checkpoint (trained there when absent)")
    parser.add_argument("--budget", type=float, default=240.0, help="training seconds when the checkpoint is absent")
    parser.add_argument("--steps", type=int, help="training steps instead of --budget (deterministic)")
    parser.add_argument("--threads", type=int, help="torch and onnxruntime threads (default: theirs, one per "
                        "core; on cores other jobs share, 1 is far faster: their spinning threads contend)")
    parser.add_argument("--windows", type=int, default=0,
                        help="validation windows (default 0: all the split's non-overlapping windows)")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--reuse", action="store_true", help="keep exports already in WORKDIR")
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint or os.path.join(args.workdir, "checkpoint")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)          # the genai builder's subprocesses
    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        train_checkpoint.train(checkpoint, budget=args.budget, steps=args.steps, threads=args.threads)
    with open(os.path.join(checkpoint, "training.json")) as f:
        trained = json.load(f)
    models, missing = deltarule_exports(checkpoint, args.workdir, reuse=args.reuse)
    genai, genai_missing = genai_exports(checkpoint, args.workdir, reuse=args.reuse)
    missing.update(genai_missing)

    windows, prompts = data(checkpoint, args.windows, args.window, args.prompts, args.prompt_length)
    with open(os.path.join(checkpoint, "config.json")) as f:
        head_dim = json.load(f)["head_dim"]
    rows = {REFERENCE: measure(Reference(checkpoint), windows, prompts, args.new, None)}
    ref = rows[REFERENCE]
    sizes = {REFERENCE: os.path.getsize(os.path.join(checkpoint, "model.safetensors"))}
    for name, path in {**models, **genai}.items():
        session = Onnx(path, sizes={"kv_cache_dim": head_dim} if name.startswith("genai") else None,
                       threads=args.threads)
        rows[name] = measure(session, windows, prompts, args.new, ref)
        sizes[name] = onnx_bytes(path)
        print(f"{name}: perplexity {rows[name]['perplexity']:.3f} ({rows[name]['seconds']:.1f} s)", flush=True)

    print(f"\n# {platform.machine()}, {os.cpu_count()} cores ({args.threads or 'default'} threads); "
          f"onnxruntime CPU; checkpoint {checkpoint}: "
          f"{trained['parameters'] / 1e6:.2f} M parameters, {trained['steps']} steps, train loss "
          f"{trained['train_loss']:.3f}, validation loss {trained['validation_loss']:.3f} nats/byte")
    print(f"# {len(windows)} windows of {args.window} validation tokens; {args.prompts} prompts of "
          f"{args.prompt_length} tokens, {args.new} greedy tokens\n")
    print(table(rows, sizes, missing, args.prompts))
    keep = ("perplexity", "ratio", "greedy_agreement", "greedy_identical", "top1_agreement", "max_logit_error",
            "seconds")
    with open(os.path.join(args.workdir, "quality.json"), "w") as f:
        json.dump(dict(checkpoint=trained, args=vars(args), missing=missing,
                       rows={n: {**{k: r[k] for k in keep}, "bytes": sizes.get(n),
                                 "path": {**models, **genai}.get(n)} for n, r in rows.items()}), f, indent=2)
    print(f"\n(written to {os.path.join(args.workdir, 'quality.json')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
