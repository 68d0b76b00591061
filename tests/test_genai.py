"""onnxruntime-genai running deltarule's ONNX export (deltarule/onnx/export/genai.py): the folder
`deltarule.onnx.export.export_model` writes (``onnx/model.onnx`` and ``genai_config.json``) generates in
onnxruntime-genai 0.18 the greedy tokens transformers generates on the same tiny random
checkpoint, from token ids (no tokenizer). Qwen3.5 runs as genai's ``qwen3_5_text`` (position
ids [3, batch, sequence]), Qwen3-Next as its generic ``decoder``.

Runs where ``onnxruntime_genai`` imports (a venv of its own: bash .ci/genai install / test).
"""

import pytest

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai 0.18 (a venv of its own: bash .ci/genai)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import deltarule.onnx.export  # noqa: E402
from deltarule.tools.bench import checkpoints  # noqa: E402

PROMPTS = ([5, 17, 99, 3, 42], [7, 200, 31, 64, 9, 128, 250, 11, 4, 77, 150, 23, 8])
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def exported(request, tmp_path_factory):
    checkpoint = checkpoints.save(request.param, str(tmp_path_factory.mktemp(request.param)))
    out = str(tmp_path_factory.mktemp(f"{request.param}_onnx"))
    deltarule.onnx.export.export_model(checkpoint, out, target="ort")
    return checkpoint, out


def transformers_tokens(checkpoint, prompt):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS)
    return out[0, len(prompt):].tolist()


def genai_tokens(folder, prompt):
    model = og.Model(folder)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + NEW_TOKENS)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"{len(p)}_tokens")
def test_greedy_tokens_equal_transformers(exported, prompt):
    checkpoint, folder = exported
    want = transformers_tokens(checkpoint, prompt)
    assert genai_tokens(folder, prompt) == want


@pytest.fixture(scope="module")
def exported_q4(tmp_path_factory):
    """Tiny Qwen3.5 at fp32 and q4 in one folder: genai_config.json names the q4 decoder."""
    checkpoint = checkpoints.save("qwen3_5", str(tmp_path_factory.mktemp("qwen3_5_q4_ck")))
    out = str(tmp_path_factory.mktemp("qwen3_5_q4"))
    return deltarule.onnx.export.export_model(checkpoint, out, dtype=["fp32", "q4"])


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"{len(p)}_tokens")
def test_q4_folder_greedy_tokens_equal_onnxruntime(exported_q4, prompt):
    """genai runs the q4 file (MatMulNBits, GatherBlockQuantized): its greedy tokens are
    onnxruntime's on the same file."""
    from deltarule.onnx.export.generate import DecoderSession
    assert exported_q4.genai_model == "onnx/model_q4.onnx"
    session = DecoderSession(exported_q4.models["q4"]["model"])
    want = session.greedy(np.array([prompt]), NEW_TOKENS, eos_token_id=2)[0].tolist()
    got = genai_tokens(exported_q4.directory, prompt)
    assert got == want[:len(got)] and (len(got) == NEW_TOKENS or got[-1] == 2)
