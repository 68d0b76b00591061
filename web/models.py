"""The export folders the web tests load (issue 35, docs/export.md "transformers.js"): tiny
random checkpoints of every hybrid family, each with a byte-level BPE tokenizer trained here with
`tokenizers` (no download), exported by `deltarule.onnx.export.export_model` as they are, and the greedy
tokens transformers generates for the same prompt, from its own PyTorch model.

    .venv/bin/python web/models.py web/models        # bash .ci/web test runs it

Writes ``OUT/<name>/`` (an export folder: onnx/, config, tokenizer) and ``OUT/index.json``:
``{"prompt", "max_new_tokens", "models": [{name (its folder under OUT), family, architecture,
model_type, prompt_ids, tokens, text, transformers_js, dtypes}], "scan": [{name, shape, kind}]}``,
where ``transformers_js`` is null when transformers.js 4.3.2 registers the model type, else why
it does not (the test then expects its refusal). ``tokens`` are the fp32 export's reference.
The Qwen3.5 folders of `QUANTIZED` also hold q8, q4 and q4f16 files; ``dtypes`` (empty for the
others) gives for each: ``ops`` (the quantized nodes, "domain.op"), ``tokens`` and ``text`` (the
greedy tokens onnxruntime (Python, `DecoderSession`) generates from that same file: quantized
files do not give transformers' fp32 tokens) and ``float_tokens`` (the same with every
MatMulNBits' ``accuracy_level`` set to 0, float32 compute, which is what onnxruntime-web's WASM
build computes; onnxruntime's CPU kernels at accuracy_level 4 quantize the activations to int8).
``OUT/qwen3_5-<shape>/`` and ``OUT/qwen3_5-<shape>-scan/`` are one Qwen3.5 checkpoint exported
fused and with each LinearAttention node replaced by its ``ai.deltarule`` function body (a
``Scan`` over tokens, as the first public exports ran), for the page's fused-vs-Scan prefill
comparison, at each ``--scan-shape`` (default tiny, and tiny with Qwen3.5-0.8B's linear-attention
heads), listed under ``scan`` in the index. Existing output is kept: delete OUT to rebuild.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import onnx
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))  # onnx_models

import deltarule.onnx.export  # noqa: E402
from deltarule.tools.bench import checkpoints  # noqa: E402
from deltarule.onnx.export.generate import DecoderSession  # noqa: E402
from deltarule.integrations import transformers as integration  # noqa: E402

PROMPT = "The gated delta rule runs in the browser, one token at a time."
MAX_NEW_TOKENS = 12
VOCAB = 384                   # the model's; the tokenizer takes the first TOKENIZER_VOCAB ids
TOKENIZER_VOCAB = 376         # Qwen3.5-VL's image / video / vision marker ids sit above it
SPECIAL = ["<|pad|>", "<|bos|>", "<|endoftext|>"]   # ids 0, 1, 2: the tiny configs' pad / bos / eos
CORPUS = [
    "The gated delta rule updates a matrix state with one rank-one correction per token.",
    "Linear attention runs in the browser with WebGPU or WebAssembly, one token at a time.",
    "Hybrid models mix softmax attention layers with Gated DeltaNet layers and short convolutions.",
    "Each decoding step reads the recurrent state, writes it back, and emits the next token.",
    "Qwen3-Next, Qwen3.5 and OLMo-Hybrid run as ONNX models in onnxruntime and transformers.js.",
] * 4

# transformers.js 4.3.2's model registry (dist/transformers.web.js: MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
# and getCacheNames): the model types it has no causal LM for
NOT_IN_TRANSFORMERS_JS = {
    "qwen3_5_moe_text": "transformers.js 4.3.2 registers Qwen3.5-MoE only as qwen3_5_moe (the "
                        "ForConditionalGeneration checkpoint Qwen publishes), no causal LM for qwen3_5_moe_text",
    "kimi_linear": "transformers.js 4.3.2 has no kimi_linear model (nor its cache names)",
}


def tokenizer(directory: str) -> transformers.PreTrainedTokenizerFast:
    """The byte-level BPE of `_trained`, saved as tokenizer.json + tokenizer_config.json in `directory`."""
    fast = _trained()
    fast.save_pretrained(directory)
    return fast


@functools.cache
def _trained() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE (Qwen's kind: ByteLevel pre-tokenizer and decoder) trained on CORPUS, once."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIAL[0], bos_token=SPECIAL[1],
                                                eos_token=SPECIAL[2])


def greedy(checkpoint: str, ids: list[int]) -> list[int]:
    """transformers' greedy tokens after `ids`, its own PyTorch model and kernels."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    prompt = torch.tensor([ids])
    eos = model.generation_config.eos_token_id
    with torch.no_grad(), integration.torch_fallback():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW_TOKENS,
                             do_sample=False, pad_token_id=0, eos_token_id=eos)
    return out[0, len(ids):].tolist()


# name -> (family, checkpoint kind): every family `deltarule.onnx.export` exports that transformers.js
# could know, as a causal LM and, for Qwen3.5 / Qwen3.5-MoE, as Qwen publishes them
MODELS = {
    "qwen3_5": ("qwen3_5", "causal_lm"),
    "qwen3_5-vl": ("qwen3_5", "conditional_generation"),
    "qwen3_5_moe": ("qwen3_5_moe", "causal_lm"),
    "qwen3_5_moe-vl": ("qwen3_5_moe", "conditional_generation"),
    "qwen3_next": ("qwen3_next", "causal_lm"),
    "olmo_hybrid": ("olmo_hybrid", "causal_lm"),
    "kimi_linear": ("kimi_linear", "causal_lm"),
}


# the folders also exported quantized (transformers.js's dtype names), and how: the causal LM with
# its embedding table float (no GatherBlockQuantized: onnxruntime-web's WASM build has no kernel
# for it), the published layout with the export's defaults (q4 / q4f16 embeddings GatherBlockQuantized)
DTYPES = ["fp32", "q8", "q4", "q4f16"]
QUANTIZED = {
    "qwen3_5": deltarule.onnx.export.Quantization(embeddings=False),
    "qwen3_5-vl": deltarule.onnx.export.Quantization(),
}


def ort_greedy(files: dict, ids: list[int], eos: int, work: str, float_compute: bool = False) -> list[int]:
    """onnxruntime's (Python, CPU) greedy tokens after `ids` from one dtype's files
    (`Exported.models[dtype]`), up to the first end of text as transformers.js stops there;
    `float_compute`: run a copy whose MatMulNBits nodes have accuracy_level 0."""
    if float_compute:
        copies = {}
        for role, path in files.items():
            model = onnx.load(path)
            for node in model.graph.node:
                if node.op_type == "MatMulNBits":
                    for a in node.attribute:
                        if a.name == "accuracy_level":
                            a.i = 0
            copies[role] = os.path.join(work, f"accuracy0-{role}.onnx")
            onnx.save(model, copies[role])
        files = copies
    if "embed_tokens" in files:
        session = DecoderSession(files["decoder_model_merged"], embed=files["embed_tokens"])
    else:
        session = DecoderSession(files["model"])
    tokens = session.greedy(np.array([ids], dtype=np.int64), MAX_NEW_TOKENS, eos_token_id=eos)[0].tolist()
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def build(name: str, out: str, work: str) -> dict:
    family, kind = MODELS[name]
    ck = os.path.join(work, name)
    if kind == "conditional_generation":
        checkpoints.save_conditional_generation(family, ck, vocab_size=VOCAB)
    else:
        checkpoints.save(family, ck, vocab_size=VOCAB)
    tok = tokenizer(ck)
    ids = tok(PROMPT)["input_ids"]
    tokens = greedy(ck, ids)
    quantization = QUANTIZED.get(name)
    ex = deltarule.onnx.export.export_model(ck, os.path.join(out, name), overwrite=True,     # (regenerated fixtures)
                               **(dict(dtype=DTYPES, quantization=quantization) if quantization else {}))
    dtypes = {}
    eos = transformers.GenerationConfig.from_pretrained(ck).eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    for d in ex.dtypes:
        if d in ex.quantized:
            ops = sorted(f"{domain}.{op}" for domain, op in ex.quantized[d].made)
            ort = ort_greedy(ex.models[d], ids, eos, work)
            dtypes[d] = dict(ops=ops, tokens=ort, text=tok.decode(ort),
                             float_tokens=ort_greedy(ex.models[d], ids, eos, work, float_compute=True))
    with open(os.path.join(ck, "config.json")) as f:
        config = json.load(f)
    model_type = config["model_type"]
    return dict(name=name, family=family, architecture=config["architectures"][0], model_type=model_type,
                prompt_ids=ids, tokens=tokens, text=tok.decode(tokens),
                transformers_js=NOT_IN_TRANSFORMERS_JS.get(model_type), dtypes=dtypes)


def scan_pair(out: str, work: str, shape: str) -> list[dict]:
    """The same Qwen3.5 checkpoint at `shape` exported fused and as Scan loops (the same graph
    with each LinearAttention node replaced by its function body: opset 23 both, which
    onnxruntime-web 1.31 takes; it refuses opset 27)."""
    from onnx_models import scan_variant
    ck = os.path.join(work, f"qwen3_5-{shape}")
    checkpoints.save("qwen3_5", ck, shape=shape, vocab_size=VOCAB)
    tokenizer(ck)
    fused = os.path.join(out, f"qwen3_5-{shape}")
    ex = deltarule.onnx.export.export_model(ck, fused, overwrite=True)
    scan = fused + "-scan"
    # config, tokenizer and any external weights file copied: the Scan graph names the same file
    shutil.copytree(fused, scan, ignore=shutil.ignore_patterns("*.onnx"))
    scan_variant(ex.path, out=os.path.join(scan, "onnx", "model.onnx"))
    return [dict(name=os.path.basename(fused), shape=shape, kind="fused"),
            dict(name=os.path.basename(scan), shape=shape, kind="scan")]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--scan-shape", action="append", choices=sorted(checkpoints.SHAPES),
                        help="shapes of the fused / Scan pairs (default: tiny and tiny_0_8b_heads)")
    args = parser.parse_args(argv)
    index = os.path.join(args.out, "index.json")
    if os.path.exists(index):
        print(f"{index} exists: kept (delete {args.out} to rebuild)")
        return
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        entries = [build(name, args.out, work) for name in MODELS]
        scan = [m for shape in args.scan_shape or ["tiny", "tiny_0_8b_heads"] for m in scan_pair(args.out, work, shape)]
    with open(index, "w") as f:
        json.dump(dict(prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS, models=entries, scan=scan), f, indent=1)
    for e in entries:
        print(e["name"], e["tokens"], e["transformers_js"] or "")
        for d, q in e["dtypes"].items():
            print(f"  {d}: onnxruntime {q['tokens']}, float compute {q['float_tokens']} ({', '.join(q['ops'])})")


if __name__ == "__main__":
    main()
