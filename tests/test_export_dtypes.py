"""`deltarule.onnx.export.export_model` at transformers.js's dtypes (deltarule/onnx/export/quantize.py): several
dtypes from one call, each in the file transformers.js resolves, quantized by onnxruntime's
weight-only quantizer with every weight MatMul (the tied LM head included) quantized; the files
run in onnxruntime; bad dtypes and quantization options are refused before anything is written."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

import deltarule  # noqa: E402
import deltarule.onnx.export  # noqa: E402
from deltarule.tools.bench import checkpoints  # noqa: E402
from deltarule.onnx.export import Quantization, lean, quantize  # noqa: E402
from deltarule.onnx.export.generate import DecoderSession  # noqa: E402

from conftest import rel  # noqa: E402

ALL = ["fp32", "fp16", "q8", "q4", "q4f16"]
FILES = {"fp32": "model.onnx", "fp16": "model_fp16.onnx", "q8": "model_quantized.onnx", "q4": "model_q4.onnx",
         "q4f16": "model_q4f16.onnx"}
PROMPT = np.array([[5, 17, 99, 3, 42, 7]])


def _tied_checkpoint(folder) -> str:
    """Tiny Qwen3.5 with a tied LM head (as Qwen3.5-0.8B): torch.onnx reaches the head's weight
    through a Transpose of the embedding table."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        config = checkpoints.config("qwen3_5", "tiny")
        config.tie_word_embeddings = True
        config.architectures = ["Qwen3_5ForCausalLM"]
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return _tied_checkpoint(tmp_path_factory.mktemp("tied"))


@pytest.fixture(scope="module")
def every_dtype(tied, tmp_path_factory):
    """The tied checkpoint at every dtype, in one call (float32 aliases fp32: not written twice)."""
    out = str(tmp_path_factory.mktemp("every"))
    return deltarule.onnx.export.export_model(tied, out, dtype=["q4", "fp32", "float32", "fp16", "q8", "q4f16"])


def _weight_matmuls(model):
    """(name, [K, N]) of the float weight MatMuls: (narrow ones, the others)."""
    found = [(n.name, list(w.dims), lean.narrow(w)) for n, w in lean.weight_matmuls(model)]
    return [(n, d) for n, d, small in found if small], [(n, d) for n, d, small in found if not small]


def _logits(path, ids=PROMPT):
    session = DecoderSession(path)
    logits, _ = session.step(ids, np.ones_like(ids), session.zero_state(ids.shape[0]))
    return logits.astype(np.float64)


def test_every_dtype_in_its_transformers_js_file(every_dtype):
    ex = every_dtype
    assert ex.dtypes == ["q4", "fp32", "fp16", "q8", "q4f16"]             # the order asked, repeats dropped
    assert list(ex.models) == ex.dtypes
    for dtype, files in ex.models.items():
        assert files == {"model": os.path.join(ex.directory, "onnx", FILES[dtype])}
        assert os.path.isfile(files["model"])
    assert ex.path == ex.models["q4"]["model"]
    assert sorted(os.listdir(os.path.join(ex.directory, "onnx"))) == sorted(FILES.values())
    with open(os.path.join(ex.directory, "genai_config.json")) as f:          # genai loads the 4-bit model
        assert json.load(f)["model"]["decoder"]["filename"] == "onnx/model_q4.onnx"
    assert ex.genai_model == "onnx/model_q4.onnx"


@pytest.mark.parametrize("dtype", ["q8", "q4", "q4f16"])
def test_every_weight_is_quantized_tied_head_included(every_dtype, dtype):
    ex = every_dtype
    model = onnx.load(ex.models[dtype]["model"])
    onnx.checker.check_model(model)
    float_model = onnx.load(ex.models["fp16" if dtype == "q4f16" else "fp32"]["model"])
    narrow, weights = _weight_matmuls(float_model)
    assert len(narrow) == 1 and narrow[0][1] == [128, 4]            # the a / b gate projections, merged
    untied = sum(1 for n in float_model.graph.node if n.op_type == "MatMul"
                 and any(p.op_type == "Transpose" and p.output[0] == n.input[1] for p in float_model.graph.node))
    assert untied == 1                                        # the float graph's head: Transpose of the table
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    assert ops.count(("com.microsoft", "MatMulNBits")) == len(weights) + untied
    assert _weight_matmuls(model) == (narrow, []) and ex.quantized[dtype].left_float == ()
    assert list(ex.quantized[dtype].kept_float) == narrow
    assert ops.count(("com.microsoft", "GatherBlockQuantized")) == (1 if dtype != "q8" else 0)
    bits = {a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    assert bits == {int(dtype[1])}
    blocks = {a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "block_size"}
    assert blocks == {32}


def test_quantized_files_are_smaller(every_dtype):
    size = {d: os.path.getsize(f["model"]) for d, f in every_dtype.models.items()}
    assert size["q4"] < 0.3 * size["fp32"] and size["q8"] < 0.45 * size["fp32"]
    assert size["q4f16"] < 0.45 * size["fp16"] and size["fp16"] < 0.55 * size["fp32"]


def test_quantized_logits_near_float(every_dtype):
    """Random weights say little about quantization quality (docs/export.md has a trained
    checkpoint's), but a wrong head or table (a transposed copy read the wrong way) is far off."""
    ref = _logits(every_dtype.models["fp32"]["model"])
    assert rel(_logits(every_dtype.models["fp16"]["model"]), ref) < 2e-3
    assert rel(_logits(every_dtype.models["q8"]["model"]), ref) < 3e-2
    for dtype in ("q4", "q4f16"):
        assert rel(_logits(every_dtype.models[dtype]["model"]), ref) < 0.3


def test_untied_head_computes_the_same(every_dtype):
    """The transposed copy the quantizer reads: the float model with it gives the same logits."""
    model = onnx.load(every_dtype.models["fp32"]["model"])
    untied = quantize._untie_transposed_weights(model)
    assert sum(n.op_type == "Transpose" for n in untied.graph.node) == \
        sum(n.op_type == "Transpose" for n in model.graph.node) - 1
    feeds = _feeds(every_dtype.models["fp32"]["model"])
    a = ort.InferenceSession(model.SerializeToString()).run(["logits"], feeds)[0]
    b = ort.InferenceSession(untied.SerializeToString()).run(["logits"], feeds)[0]
    assert rel(b, a) < 1e-6


def _feeds(path):
    session = DecoderSession(path)
    state = session.zero_state(1)
    return {"input_ids": PROMPT, "attention_mask": np.ones_like(PROMPT), **state}


def test_q4_greedy_in_onnxruntime_and_runner(every_dtype):
    """The q4 file's greedy tokens, onnxruntime step by step against one prefill per token
    (the state round trip of a quantized graph)."""
    path = every_dtype.models["q4"]["model"]
    tokens = DecoderSession(path).greedy(PROMPT, 6)
    ids = PROMPT
    for t in range(6):
        nxt = _logits(path, ids)[:, -1].argmax(-1)
        assert nxt[0] == tokens[0, t]
        ids = np.concatenate([ids, nxt[:, None]], axis=1)


def test_standard_target_quantizes_to_dequantize_linear(tied, every_dtype, tmp_path):
    """The "onnx" target keeps to standard ops: blocked DequantizeLinear -> MatMul (the
    options reach the quantizer: blocks of 16, zero points)."""
    ex = deltarule.onnx.export.export_model(tied, str(tmp_path / "out"), target="onnx", dtype="q4",
                               quantization=Quantization(block_size=16, symmetric=False))
    model = onnx.load(ex.models["q4"]["model"])
    assert not any(n.domain == "com.microsoft" for n in model.graph.node)
    dequantize = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    narrow, weights = _weight_matmuls(model)
    assert len(dequantize) == sum(1 for n in model.graph.node if n.op_type == "MatMul") - len(narrow) > 0
    assert weights == []
    assert {a.i for n in dequantize for a in n.attribute if a.name == "block_size"} == {16}
    assert all(len(n.input) == 3 for n in dequantize)                  # zero points: asymmetric
    assert rel(_logits(ex.models["q4"]["model"]), _logits(every_dtype.models["fp32"]["model"])) < 0.3


def test_text_only_pair_at_each_dtype(tmp_path):
    """A ...ForConditionalGeneration checkpoint: embed_tokens<suffix> / decoder_model_merged<suffix>
    per dtype; the q4 pair generates the q4 decoder's tokens."""
    ck = checkpoints.save_conditional_generation("qwen3_5", str(tmp_path / "ck"))
    ex = deltarule.onnx.export.export_model(ck, str(tmp_path / "out"), dtype=["q4", "fp32"])
    onnx_dir = os.path.join(ex.directory, "onnx")
    assert sorted(os.listdir(onnx_dir)) == sorted(
        ["model.onnx", "embed_tokens.onnx", "decoder_model_merged.onnx",
         "model_q4.onnx", "embed_tokens_q4.onnx", "decoder_model_merged_q4.onnx"])
    assert ex.text_only == {"embed_tokens": os.path.join(onnx_dir, "embed_tokens_q4.onnx"),
                            "decoder_model_merged": os.path.join(onnx_dir, "decoder_model_merged_q4.onnx")}
    embed = onnx.load(ex.text_only["embed_tokens"])
    assert [n.op_type for n in embed.graph.node if n.domain == "com.microsoft"] == ["GatherBlockQuantized"]
    pair = DecoderSession(ex.text_only["decoder_model_merged"], embed=ex.text_only["embed_tokens"])
    np.testing.assert_array_equal(pair.greedy(PROMPT, 6), DecoderSession(ex.path).greedy(PROMPT, 6))


@pytest.mark.parametrize("kwargs, argument", [
    (dict(dtype="q5"), "dtype"), (dict(dtype="int4"), "dtype"), (dict(dtype=[]), "dtype"),
    (dict(dtype=["fp32", 4]), "dtype"), (dict(dtype=b"q4"), "dtype"),
    (dict(dtype="fp32", quantization=Quantization()), "quantization"),
    (dict(dtype="q4", quantization=dict(block_size=32)), "quantization"),
    (dict(dtype="q4", quantization=Quantization(block_size=24)), "quantization.block_size"),
    (dict(dtype="q4", quantization=Quantization(accuracy_level=5)), "quantization.accuracy_level"),
    (dict(dtype="q4", quantization=Quantization(symmetric=1)), "quantization.symmetric"),
    (dict(dtype="q4", target="ort-cpu"), "target"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_dtype_or_quantization_refused_before_writing(tied, tmp_path, kwargs, argument):
    out = tmp_path / "out"
    with pytest.raises(deltarule.ContractError) as info:
        deltarule.onnx.export.export_model(tied, str(out), **kwargs)
    assert info.value.argument == argument
    assert not out.exists() or not any(out.iterdir())
    assert [p.name for p in tmp_path.iterdir() if p.name != "out"] == []          # no staging folder left


def test_cli_dtypes_and_refusal(tied, tmp_path, capsys):
    from deltarule.tools import cli
    from deltarule.onnx.export import graph
    assert cli.EXPORT_DTYPES == (*quantize.DTYPES, *quantize.ALIASES)
    assert cli.EXPORT_TARGETS == tuple(graph.TARGETS)
    with pytest.raises(SystemExit) as exit_:                         # argparse: a usage error
        cli.main(["export", "onnx", tied, str(tmp_path / "bad"), "--dtype", "q5"])
    assert exit_.value.code == 2 and "--dtype" in capsys.readouterr().err
    main = cli.main
    assert main(["export", "onnx", tied, str(tmp_path / "bad2"), "--block-size", "32"]) == 2
    assert "quantization" in capsys.readouterr().err


def test_sibling_matmuls_merged(every_dtype):
    """One MatMul per activation read by several weights: each layer's q / k / v, the MLP's
    gate / up, Gated DeltaNet's qkv / z (and its a / b, among themselves)."""
    model = onnx.load(every_dtype.models["fp32"]["model"])
    readers = {}
    for node, weight in lean.weight_matmuls(model):
        readers.setdefault((node.input[0], lean.narrow(weight)), []).append(node.name)
    assert all(len(names) == 1 for names in readers.values()), readers
    assert sum(n.op_type == "Split" and n.name.endswith(".split") for n in model.graph.node) == 5


def test_num_logits_to_keep(tied, every_dtype, tmp_path):
    """The decoder takes num_logits_to_keep (0: every position, n: the last n) and computes only
    those rows; the repeated key / value heads before Attention are gone; greedy tokens are the
    full decoder's; no genai_config.json (genai does not feed the input)."""
    full = every_dtype.models["fp32"]["model"]
    ex = deltarule.onnx.export.export_model(tied, str(tmp_path / "last"), dtype=["fp32", "q4"], num_logits_to_keep=True)
    assert ex.inputs[-1] == "num_logits_to_keep" and ex.genai_model is None and ex.no_genai_config
    assert not os.path.exists(os.path.join(ex.directory, "genai_config.json"))
    model = onnx.load(ex.path)
    assert [i.name for i in model.graph.input][-1] == "num_logits_to_keep"
    attention = [n for n in model.graph.node if n.op_type == "Attention"]
    assert attention and all(n.input[1].startswith("present.") and n.input[2].startswith("present.")
                             for n in attention)                 # the cache itself, no repeated copy
    ids = np.array([[5, 17, 99, 3, 42, 7, 8, 9]])
    want = _logits(full, ids)
    session = DecoderSession(ex.path)
    state = session.zero_state(1)
    for keep, rows in ((0, 8), (1, 1), (3, 3), (20, 8)):
        got, present = session.step(ids, np.ones_like(ids), state, keep_logits=keep)
        assert got.shape == (1, rows, want.shape[-1])
        assert rel(got, want[:, -rows:]) < 1e-6
    np.testing.assert_array_equal(session.greedy(PROMPT, 6), DecoderSession(full).greedy(PROMPT, 6))
    q4 = onnx.load(ex.models["q4"]["model"])
    assert [i.name for i in q4.graph.input][-1] == "num_logits_to_keep"


def test_moe_experts_left_float_are_named(tmp_path):
    """The quantizer takes 2-D weights only: a MoE layer's batched expert weights stay float,
    and the export says so (Exported.quantized[dtype].left_float), the rest quantized."""
    ck = checkpoints.save("qwen3_5_moe", str(tmp_path / "ck"))
    ex = deltarule.onnx.export.export_model(ck, str(tmp_path / "out"), dtype="q4")
    left = ex.quantized["q4"].left_float
    assert left and all(len(shape) == 3 for _, shape in left)
    assert ex.quantized["q4"].made[("com.microsoft", "MatMulNBits")] > 0
    assert DecoderSession(ex.path).greedy(PROMPT, 3).shape == (1, 3)
