"""deltarule.integrations.transformers: transformers' hybrid models with their linear layers on deltarule.

Every family the installed transformers binds fla's kernels in is built here as
a tiny random-weight model (no download) and run twice: on deltarule after
`enable()`, and on transformers' own PyTorch fallback (`torch_fallback()`, also
where fla is installed and its GPU kernels would fail here). Both runs are
float32; they agree to ~1e-7, the bound is 1e-4. Every comparison also checks
that deltarule was called, so a run that silently stayed on the fallback fails.
"""

import importlib
import inspect
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0", reason="pip install 'transformers>=5'")

import deltarule  # noqa: E402
import deltarule.contracts.fla as fla_drop_ins  # noqa: E402
import deltarule.integrations.hf_kernels as hf_kernels  # noqa: E402
import deltarule.integrations.transformers as dt  # noqa: E402
from conftest import rel  # noqa: E402

TOL = 1e-4
NEW_TOKENS = 12
PAD = 0

_LAYERS = ["linear_attention", "full_attention"]
_BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, layer_types=_LAYERS, pad_token_id=PAD, eos_token_id=2)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_MLA = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            moe_intermediate_size=32, num_experts_per_tok=2, n_group=1, topk_group=1, layer_types=_LAYERS,
            pad_token_id=PAD, bos_token_id=1, eos_token_id=2, intermediate_size=128)
_KDA = dict(linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4)


def _glm5_next(base, mla):
    text = dict(mla, q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=16, head_dim=0, n_routed_experts=4,
                index_topk=8, index_head_dim=16, index_n_heads=2, index_kpool=4, hc_mult=2, **_KDA)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                  projection_intermediate_size=64)
    special = dict(image_token_id=120, video_token_id=121, image_start_token_id=122, image_end_token_id=123,
                   video_start_token_id=124, video_end_token_id=125)
    config = transformers.Glm5NextConfig(text_config=transformers.Glm5NextTextConfig(**text).to_dict(),
                                         vision_config=vision, **special)
    return transformers.Glm5NextForConditionalGeneration(config)


def _qwen4_exp(base, mla):
    return transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(
        **base, **_GDN, **_MOE, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
        indexer_compress_ratio=4, hc_count=2, hc_lowrank=8, ngram_vocab_size_base=1024,
        make_ngram_vocab_size_divisible_by=8, split_ngram_parts=8, heads_per_ngram=2))


# One tiny model per family, from the base keywords of GDN and MLA (KDA) models. By default one
# linear-attention and one softmax-attention layer (a model with only linear layers fails in
# transformers itself with the default use_cache=True).
TINY = {
    "qwen3_next": lambda base, mla: transformers.Qwen3NextForCausalLM(
        transformers.Qwen3NextConfig(**base, **_GDN, **_MOE, intermediate_size=128)),
    "qwen3_5": lambda base, mla: transformers.Qwen3_5ForCausalLM(
        transformers.Qwen3_5TextConfig(**base, **_GDN, intermediate_size=128)),
    "qwen3_5_moe": lambda base, mla: transformers.Qwen3_5MoeForCausalLM(
        transformers.Qwen3_5MoeTextConfig(**base, **_GDN, **_MOE)),
    "lara_mini": lambda base, mla: transformers.LaraMiniForCausalLM(
        transformers.LaraMiniConfig(**base, **_GDN, **_MOE)),
    "olmo_hybrid": lambda base, mla: transformers.OlmoHybridForCausalLM(transformers.OlmoHybridConfig(
        **{k: v for k, v in base.items() if k != "head_dim"}, **_GDN, intermediate_size=128)),
    "qwen4_exp": _qwen4_exp,
    "kimi_linear": lambda base, mla: transformers.KimiLinearForCausalLM(
        transformers.KimiLinearConfig(**mla, num_local_experts=4, **_KDA)),
    "bailing_hybrid": lambda base, mla: transformers.BailingHybridForCausalLM(transformers.BailingHybridConfig(
        **mla, num_local_experts=4, head_dim=16, short_conv_kernel_size=4, first_k_dense_replace=1,
        num_mtp_layers=0)),
    "glm5_next": _glm5_next,
}
# glm5_next's softmax (indexed MLA) attention in transformers 5.24.0 mixes packed sequences by
# itself (measured: 0.8 relative error with deltarule's layer alone exact), so its packed test
# runs a model of linear-attention layers only.
PACKED_LINEAR_ONLY = {"glm5_next"}

FOUND = sorted({b.family for b in dt.bindings()})


@pytest.fixture(scope="module", autouse=True)
def enabled():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = dt.enable()
    yield found
    dt.disable()


class Calls:
    """Counts the fla drop-ins' calls of deltarule's operator (`api.call`); `backend` forces one."""

    def __init__(self, call):
        self.n = 0
        self.backend = "auto"
        self.call = call

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self.call(*args, **{**kwargs, "backend": self.backend})


@pytest.fixture
def calls(monkeypatch):
    counter = Calls(fla_drop_ins._call)
    monkeypatch.setattr(fla_drop_ins, "_call", counter)
    return counter


def tiny(family: str, layers: list[str] = _LAYERS):
    torch.manual_seed(0)
    return TINY[family](dict(_BASE, layer_types=layers), dict(_MLA, layer_types=layers)).eval()


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Batch 2, T = 70 (past one 64-token chunk): row 0 left-padded by 9, row 1 full."""
    ids = torch.randint(3, 120, (2, 70), generator=torch.Generator().manual_seed(3))
    ids[0, :9] = PAD
    return ids, (ids != PAD).long()


def generate(model, ids, mask):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=PAD)
    return out.sequences, torch.stack(out.logits)


def test_every_family_found_has_a_tiny_model():
    """A family a newer transformers adds fails here until it has a tiny model and runs in these tests."""
    assert FOUND, "no family found"
    assert set(FOUND) <= set(TINY), sorted(set(FOUND) - set(TINY))
    for family in FOUND:
        kernels = {b.kernel for b in dt.bindings() if b.family == family}
        assert {"causal_conv1d_fn"} < kernels and kernels - {"causal_conv1d_fn"} in (
            {"chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"}, {"chunk_kda", "fused_recurrent_kda"})


def _running(module, attribute: str):
    """The function a binding runs now: its module attribute, or (kernels' form, 5.25 on) the
    instance forward kernelize gave it, or kernels' own Func.forward."""
    bound = getattr(module, attribute)
    if dt._is_kernelizable(bound):
        forward = bound.__dict__.get("forward", type(bound).forward)
        return getattr(forward, "__func__", forward)
    return bound


KERNELS_FORM = dt._is_kernelizable(
    getattr(importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next"),
            "torch_chunk_gated_delta_rule"))


def test_enable_binds_deltarule_and_disable_restores():
    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    name = "torch_chunk_gated_delta_rule"
    ours = hf_kernels.ChunkGatedDeltaRule.forward if KERNELS_FORM else None
    if KERNELS_FORM:
        assert _running(module, name) is ours
        assert module.torch_chunk_gated_delta_rule.__dict__["_kernel_repo"].layer_name == "ChunkGatedDeltaRule"
    else:
        assert _running(module, name).__name__ == "deltarule_chunk_gated_delta_rule"
    before = {b: dict(vars(getattr(importlib.import_module(b.module), b.attribute))) for b in dt.bindings()}
    dt.disable()
    assert not dt.enabled()
    restored = _running(module, name)
    assert restored is not ours and not restored.__name__.startswith("deltarule_")
    if KERNELS_FORM:                              # exactly what was there: kernels' own forward, no repository
        assert all("forward" not in vars(getattr(importlib.import_module(b.module), b.attribute)) for b in before)
    else:
        assert callable(restored.__wrapped__)
    dt.enable()
    dt.enable()                                   # twice: still one layer of replacement
    again = _running(module, name)
    assert again is ours if KERNELS_FORM else again.__wrapped__ is fla_drop_ins.chunk_gated_delta_rule
    fallback = dt._torch_function(getattr(module, name))
    with dt.torch_fallback():
        assert _running(module, name) is fallback and fallback.__name__ == name
    assert _running(module, name) is again


def test_a_family_not_recognised_stays_on_transformers(monkeypatch):
    """One warning naming the family, the attribute and the version; the family is left whole
    (nothing half-bound), the others are bound; strict=True raises and binds nothing."""
    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    dt.disable()
    untouched = {b.attribute: _running(module, b.attribute) for b in dt.bindings() if b.family == "qwen3_next"}
    strange = lambda *args, **kwargs: None  # noqa: E731   (no __wrapped__, not kernels' Func)
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", strange)
    try:
        with pytest.warns(RuntimeWarning, match=r"'qwen3_next'.*torch_chunk_gated_delta_rule.*transformers "
                          + transformers.__version__.replace(".", r"\.")) as caught:
            result = dt.enable()
        assert len([w for w in caught if "qwen3_next" in str(w.message)]) == 1
        assert "qwen3_next" not in result.families and set(result.families) == set(FOUND) - {"qwen3_next"}
        assert "torch_chunk_gated_delta_rule" in result.left["qwen3_next"]
        assert all(b.family != "qwen3_next" for b in result.bound)
        for attribute, function in untouched.items():
            if attribute != "torch_chunk_gated_delta_rule":
                assert _running(module, attribute) is function, attribute
        dt.disable()
        with pytest.raises(deltarule.Unsupported, match="qwen3_next: .*torch_chunk_gated_delta_rule"):
            dt.enable(strict=True)
        assert not dt.enabled()
        with pytest.raises(deltarule.ContractError, match="strict"):
            dt.enable(strict=1)
    finally:
        monkeypatch.undo()
        dt.enable()


@pytest.mark.skipif(not KERNELS_FORM, reason="transformers binds through HF kernels from 5.25 on")
def test_kernels_signature_drift_is_refused(monkeypatch):
    """A release whose function takes other parameters than deltarule's layer is not kernelized."""
    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    func = module.torch_chunk_gated_delta_rule
    sig = inspect.signature(type(func).forward)
    changed = sig.replace(parameters=[*list(sig.parameters.values())[:6],
                                      inspect.Parameter("new_flag", inspect.Parameter.KEYWORD_ONLY, default=0)])
    monkeypatch.setattr(type(func).forward, "__signature__", changed)
    assert "new_flag" in hf_kernels.matches(func, "chunk_gated_delta_rule")
    with pytest.warns(RuntimeWarning, match="'qwen3_next'.*torch_chunk_gated_delta_rule.*new_flag"):
        result = dt.enable()
    assert "qwen3_next" in result.left
    monkeypatch.undo()
    dt.enable()


@pytest.mark.skipif(not KERNELS_FORM, reason="transformers binds through HF kernels from 5.25 on")
def test_per_model_kernelize_and_from_pretrained(calls, tmp_path):
    """kernels' own route, per model: `kernelize` with deltarule's mapping (the local repository),
    and `from_pretrained` inside `use_kernel_mapping` (it kernelizes by default from 5.25 on)."""
    import kernels

    dt.disable()
    try:
        model = tiny("qwen3_5")
        ids, mask = prompts()
        ref_tokens, ref_logits = generate(model, ids, mask)
        assert calls.n == 0                                   # transformers' own path
        with kernels.use_kernel_mapping(hf_kernels.kernel_mapping()):
            kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device="cpu")
        tokens, logits = generate(model, ids, mask)
        assert calls.n >= NEW_TOKENS and torch.equal(tokens, ref_tokens) and rel(logits, ref_logits) <= TOL
        model.save_pretrained(tmp_path)
        n = calls.n
        with kernels.use_kernel_mapping(hf_kernels.kernel_mapping()):
            loaded = type(model).from_pretrained(tmp_path).eval()
        tokens, _ = generate(loaded, ids, mask)
        assert calls.n > n and torch.equal(tokens, ref_tokens)
    finally:
        dt.enable()


@pytest.mark.parametrize("family", FOUND)
def test_generate_matches_fallback(family, calls):
    """Batch 2 with left padding, prefill past a chunk, 12 greedy tokens of cached decode."""
    model = tiny(family)
    ids, mask = prompts()
    tokens, logits = generate(model, ids, mask)
    assert calls.n >= 1 + NEW_TOKENS - 1, calls            # the prefill and every decode step
    n = calls.n
    with dt.torch_fallback():
        ref_tokens, ref_logits = generate(model, ids, mask)
    assert calls.n == n                                      # the reference run stayed off deltarule
    assert tokens.shape == (2, 70 + NEW_TOKENS)
    assert torch.equal(tokens, ref_tokens)
    assert rel(logits, ref_logits) <= TOL


def _logits(model, ids, **kwargs):
    out = model(ids, use_cache=False, **kwargs)
    return out.logits


@pytest.mark.parametrize("family", FOUND)
def test_packed_sequences_stay_apart(family, calls):
    """One packed row of sequences of 23, 1 and 40 tokens equals the three run apart."""
    model = tiny(family, ["linear_attention"] * 2 if family in PACKED_LINEAR_ONLY else _LAYERS)
    lengths = [23, 1, 40]
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 120, (1, n), generator=gen) for n in lengths]
    cu = torch.tensor([0, 23, 24, 64], dtype=torch.int32)
    packed = dict(position_ids=torch.cat([torch.arange(n) for n in lengths])[None], cu_seq_lens_q=cu,
                  cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    with torch.no_grad():
        together = _logits(model, torch.cat(seqs, 1), **packed)
        assert calls.n == model.config.get_text_config().layer_types.count("linear_attention")
        apart = [_logits(model, s) for s in seqs]
    for (start, end), alone in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), apart):
        assert rel(together[:, start:end], alone) <= TOL


@pytest.mark.parametrize("family", FOUND)
def test_gradients_match_oracle_and_fallback(family, calls):
    """Every parameter's gradient of a language-model loss through deltarule's backward.

    Per parameter against the same model with the recurrence on deltarule's float64 oracle
    (the "reference" backend); all of them together against transformers' fallback. The
    fallback is not the per-parameter oracle: under the strong decay of these random models
    (g down to -21 per token) its chunked form loses accuracy in the decay's gradient, even
    in float64 (its dt_bias gradient measured 1e-3 off the exact one in lara_mini and qwen4_exp,
    where deltarule's matched finite differences to 7 digits).
    """
    model = tiny(family)
    ids = torch.randint(3, 120, (2, 33), generator=torch.Generator().manual_seed(7))

    def grads():
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(ids, use_cache=False).logits.flatten(0, 1), ids.flatten())
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ours = grads()
    assert calls.n == 1
    calls.backend = "reference"
    oracle = grads()
    assert calls.n == 2
    with dt.torch_fallback():
        fallback = grads()
    assert ours.keys() == oracle.keys() == fallback.keys()
    bad = {n: f"{rel(ours[n], oracle[n]):.1e}" for n in ours if not rel(ours[n], oracle[n]) <= TOL}
    assert not bad, bad
    flat = lambda grads: torch.cat([g.flatten() for g in grads.values()])  # noqa: E731
    assert rel(flat(ours), flat(fallback)) <= TOL


class _CudaLike:
    is_cuda = True


def test_cuda_tensors_go_to_fla_unless_asked():
    """The routing rule on its own (no GPU here): cuda="fla" hands CUDA tensors to transformers' fla binding."""
    seen = []
    to_fla = dt._recurrence("chunk_gated_delta_rule", lambda q, k, v, **kw: seen.append(kw) or "fla", to_fla=True)
    assert to_fla(_CudaLike(), None, None, g=1, use_cache=True) == "fla" and seen == [{"g": 1, "use_cache": True}]
    assert dt._recurrence("chunk_gated_delta_rule", None).__wrapped__ is fla_drop_ins.chunk_gated_delta_rule
    # the kernels form (5.25 on): the layers send CUDA tensors back to transformers' binding after cuda="fla"
    try:
        dt.enable(cuda="deltarule")
        assert not hf_kernels._to_transformers(_CudaLike())
        dt.enable(cuda="fla")
        assert hf_kernels._to_transformers(_CudaLike()) and not hf_kernels._to_transformers(_CudaLike(), packed=True)
    finally:
        dt.enable()
    with pytest.raises(deltarule.ContractError, match="cuda"):
        dt.enable(cuda="gpu")


def test_unsupported_transformers_is_refused(monkeypatch, tmp_path):
    # by name: transformers replaces its module object in sys.modules while it loads
    monkeypatch.setattr("transformers.__version__", "4.57.6")
    with pytest.raises(deltarule.Unsupported, match="transformers 4.57.6 is not supported"):
        dt.enable()
    monkeypatch.undo()
    monkeypatch.setattr("transformers.models.__path__", [str(tmp_path)])
    with pytest.raises(deltarule.Unsupported, match="binds none of"):
        dt.bindings()


def test_scan_reads_only_fla_modules():
    source = '''
@use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "causal_conv1d")
def causal_conv1d_fn(x):
    pass

@use_kernel_func_from_hub_with_fallback("chunk_kda", "fla", internal_path="ops")
def my_chunk(q):
    pass
'''
    assert [(b.attribute, b.kernel) for b in dt._scan("fam", "m", source)] == [
        ("causal_conv1d_fn", "causal_conv1d_fn"), ("my_chunk", "chunk_kda")]
    assert dt._scan("mamba", "m", source.split("@use_kernel_func_from_hub_with_fallback(\"chunk_kda\"")[0]) == []


@pytest.mark.parametrize("lengths", [None, [5], [3, 0, 9], [1, 1, 1, 12]],
                         ids=lambda n: "unpacked" if n is None else "L" + "-".join(map(str, n)))
def test_conv_equals_torch_conv_per_sequence(lengths):
    """deltarule's causal_conv1d against F.conv1d run on each sequence alone, on the layers'
    token-major input; the output keeps that layout (what makes the q, k, v copies cheap)."""
    import torch.nn.functional as F
    from transformers.activations import ACT2FN

    gen = torch.Generator().manual_seed(1)
    T, C, W = sum(lengths or [13]), 6, 4
    x = torch.randn(1, T, C, generator=gen).transpose(1, 2)          # [1, C, T], T-major memory
    w, b = torch.randn(C, W, generator=gen), torch.randn(C, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths or [T]).cumsum(0).tolist()])
    out = dt.causal_conv1d(x, w, b, activation="silu", cu_seqlens=None if lengths is None else cu)
    assert out.shape == x.shape and out.stride() == x.stride()
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if start == end:
            continue
        alone = ACT2FN["silu"](F.conv1d(x[..., start:end], w[:, None], b, padding=W - 1, groups=C)[..., :end - start])
        assert torch.allclose(out[..., start:end], alone, atol=1e-6, rtol=1e-6)
    with pytest.raises(deltarule.ContractError, match="cu_seq_lens_q"):
        dt.causal_conv1d(x, w, cu_seqlens=cu[:-1])


def test_bench_model_reports_both_modes(monkeypatch, tmp_path, capsys):
    """`deltarule bench --model`, on a shrunken qwen3_5 so that it runs in seconds."""
    import json

    from deltarule.tools import cli
    from deltarule.tools.bench import model as bench_model

    small = dict(bench_model.MODELS["qwen3_5"])
    small["kwargs"] = dict(small["kwargs"], vocab_size=512, hidden_size=128, intermediate_size=256,
                           num_attention_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=32, linear_value_head_dim=32)
    monkeypatch.setitem(bench_model.MODELS, "qwen3_5", small)
    monkeypatch.setitem(bench_model.SIZES, "quick", (70, 9, 4))
    out = tmp_path / "model.json"
    assert cli.main(["bench", "--model", "qwen3_5", "--quick", "--repeat", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "8 layers (6 linear-attention)" in text and "per recurrence call" in text
    result = json.loads(out.read_text())["model"]
    for mode in ("fallback", "deltarule"):
        r = result[mode]
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
        assert 0 < r["prefill_recurrence_share"] < r["prefill_linear_share"] < 1
        assert 0 < r["decode_recurrence_share"] < r["decode_linear_share"] < 1
        assert r["decode_layer_us"] > r["decode_call_us"] > 0


def test_bench_model_refuses_a_family_left_unbound(monkeypatch, capsys):
    """A family whose binding is not recognised is not benchmarked as if it ran on deltarule."""
    from deltarule.tools import cli

    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", lambda *args, **kwargs: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main(["bench", "--model", "qwen3_5", "--quick"]) == 2
    assert "qwen3_5" in capsys.readouterr().err and not dt.enabled()
    monkeypatch.undo()
    dt.enable()


def test_example_generates_the_same_tokens(capsys):
    import runpy
    from pathlib import Path

    example = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "transformers_cpu.py"))
    assert example["main"](["--small", "--prompt-tokens", "20", "--new-tokens", "6"]) == 0
    assert "greedy tokens equal: True" in capsys.readouterr().out
    assert not dt.enabled()                   # the example's disable() put transformers' bindings back
    dt.enable()                               # for the module fixture


class _Graphs:
    """A Dynamo backend that keeps the graphs it compiles and runs them eagerly (fast on CPU)."""

    def __init__(self):
        self.targets = []

    def __deepcopy__(self, memo):                            # CompileConfig.to_dict deep-copies its backend
        return self

    def __call__(self, gm, example_inputs, **options):
        self.targets += [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        return gm.forward


# qwen4_exp's softmax attention has a sparse indexer that reads `torch.nonzero` counts per query
# in Python (transformers 5.24.0, modeling_qwen4_exp.py): Dynamo refuses that data-dependent
# branch under fullgraph with or without deltarule, so the model cannot compile whole.
COMPILE_REFUSED_BY_TRANSFORMERS = {"qwen4_exp"}


@pytest.mark.parametrize("family", [f for f in FOUND if f not in COMPILE_REFUSED_BY_TRANSFORMERS])
def test_generate_compiled_fullgraph_matches_eager(family):
    """transformers' compiled decode (`compile_config`, a static cache, `fullgraph=True`) runs the
    linear layers as deltarule's custom op with no graph break, with the tokens and scores of the
    eager run (transformers' own `test_generate_compile_model_forward_fullgraph`)."""
    model = tiny(family)
    ids = torch.randint(3, 120, (2, 9), generator=torch.Generator().manual_seed(3))
    graphs = _Graphs()
    config = transformers.CompileConfig(fullgraph=True, dynamic=False, backend=graphs, mode=None)
    config._compile_all_devices = True                       # transformers compiles only for CUDA otherwise
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=PAD,
                  return_dict_in_generate=True, output_scores=True)
    torch._dynamo.reset()
    with torch.no_grad():
        with torch.compiler.set_stance("force_eager"):
            eager = model.generate(ids, **kwargs)
        compiled = model.generate(ids, cache_implementation="static", compile_config=config, **kwargs)
    assert hasattr(model, "_compiled_call") and any(t.startswith("deltarule.") for t in graphs.targets)
    assert torch.equal(compiled.sequences, eager.sequences)
    assert rel(torch.stack(compiled.scores), torch.stack(eager.scores)) <= TOL
