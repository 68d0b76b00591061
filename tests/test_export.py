"""`deltarule.onnx.export.export_model`: every hybrid family transformers ships, exported from a tiny random
checkpoint, runs in onnxruntime (and through `deltarule.onnx.run`, and onnx's reference
evaluator) with transformers' logits and greedy tokens; the graph has one fused node per
linear layer and no token loop; what cannot be exported is refused at export time."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

import onnx  # noqa: E402

import deltarule  # noqa: E402
import deltarule.onnx.export  # noqa: E402
from deltarule.tools.bench import checkpoints  # noqa: E402
from deltarule.onnx.export.generate import DecoderSession  # noqa: E402
from deltarule.integrations import transformers as integration  # noqa: E402

from conftest import rel  # noqa: E402

FAMILIES = checkpoints.FAMILIES
LOGITS_TOL = {"float32": 5e-6, "float16": 2e-3}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="module")
def exported(root):
    """(family, target, dtype) -> (checkpoint folder, `Exported`), each exported once."""
    done = {}

    def get(family, target="ort", dtype="float32"):
        if (family, target, dtype) not in done:
            ck = checkpoints.save(family, str(root / f"ck-{family}-{dtype}"), dtype=dtype)
            done[family, target, dtype] = ck, deltarule.onnx.export.export_model(ck, str(root / f"{family}-{target}-{dtype}"),
                                                                   target=target, dtype=dtype)
        return done[family, target, dtype]
    return get


def _model(ck, dtype=torch.float32):
    config = transformers.AutoConfig.from_pretrained(ck)
    config._experts_implementation = "batched_mm"
    return transformers.AutoModelForCausalLM.from_pretrained(ck, config=config, dtype=dtype).eval()


def _subgraphs(graph):
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for g in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from _subgraphs(g)


# the onnx target for one Gated DeltaNet family and KDA (its graph walk is the ort target's)
@pytest.mark.parametrize("family, target", [(f, "ort") for f in FAMILIES] + [("qwen3_5", "onnx"),
                                                                                ("kimi_linear", "onnx")])
def test_graph_has_one_fused_node_per_layer_and_no_token_loop(exported, family, target):
    _, ex = exported(family, target)
    model = onnx.load(ex.path)
    nodes = [(n.domain, n.op_type) for g in _subgraphs(model.graph) for n in g.node]
    assert not [n for n in nodes if n[1] in ("Scan", "Loop", "If")], "a control-flow node in the export"
    domain = {"ort": "com.microsoft", "onnx": ""}[target]
    linear = len(ex.layout.linear_layers)
    assert linear >= 1
    assert nodes.count((domain, "LinearAttention")) == linear
    assert nodes.count((domain, "CausalConvWithState")) == linear
    assert not [n for n in nodes if n[0].startswith("ai.deltarule")], "a placeholder op left in the graph"
    imports = {o.domain: o.version for o in model.opset_import}
    assert imports.get("com.microsoft" if target == "ort" else "") == (1 if target == "ort" else 27)
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_names_and_dimensions_are_transformers_js(exported, family):
    _, ex = exported(family)
    model = onnx.load(ex.path)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in (*model.graph.input, *model.graph.output)}
    assert ex.inputs == [v.name for v in model.graph.input] and ex.outputs == [v.name for v in model.graph.output]
    assert dims["input_ids"] == ["batch_size", "sequence_length"]
    assert dims["attention_mask"] == ["batch_size", "total_sequence_length"]
    if family.startswith("qwen3_5"):              # positions from the mask (decoder.MROPE)
        assert "position_ids" not in dims
    else:
        assert dims["position_ids"] == ["batch_size", "sequence_length"]
    assert dims["logits"][:2] == ["batch_size", "sequence_length"]
    layer_types = ex.layout.model_type and _model_config(exported, family).layer_types
    for i, kind in enumerate(layer_types):
        if kind == "full_attention":
            for part in ("key", "value"):
                assert dims[f"past_key_values.{i}.{part}"][::2] == ["batch_size", "past_sequence_length"]
                assert dims[f"present.{i}.{part}"][::2] == ["batch_size", "total_sequence_length"]
        else:
            convs = [f"past_conv.{i}.{p}" for p in ("query", "key", "value")] if family == "olmo_hybrid" \
                else [f"past_conv.{i}"]
            for name in convs + [f"past_recurrent.{i}"]:
                assert dims[name][0] == "batch_size" and all(isinstance(d, int) for d in dims[name][1:]), name
                present = "present_" + name[len("past_"):]
                assert dims[present] == dims[name], present


def _model_config(exported, family):
    ck, _ = exported(family)
    from deltarule.onnx.export.decoder import text_config
    return text_config(transformers.AutoConfig.from_pretrained(ck))


def _padded_prompts(vocab, lengths, seed=0):
    """Left-padded prompts of mixed lengths: (ids [B, T], mask [B, T])."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, T - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[b, T - n:] = 1
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_ort_logits_equal_transformers_on_prompts_of_mixed_lengths(exported, family):
    """Prefill of a padded batch (from zero states, past 0), then decode steps feeding the present
    state back: each step's logits against transformers' (its own PyTorch kernels) on the
    whole sequence at once."""
    ck, ex = exported(family)
    model = _model(ck)
    session = DecoderSession(ex.path)
    ids, mask = _padded_prompts(256, [9, 3, 70])
    steps = torch.randint(3, 256, (3, 4), generator=torch.Generator().manual_seed(1))
    full_ids, full_mask = torch.cat((ids, steps), 1), torch.cat((mask, torch.ones_like(steps)), 1)
    position_ids = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), integration.torch_fallback():
        want = model(full_ids, attention_mask=full_mask, position_ids=position_ids).logits.numpy()
    got, past = _step(session, ids, mask, position_ids[:, :ids.shape[1]], session.zero_state(3))
    live = mask.bool().numpy()
    assert rel(got[live], want[:, :ids.shape[1]][live]) < LOGITS_TOL["float32"]
    for t in range(steps.shape[1]):
        n = ids.shape[1] + t
        got, past = _step(session, steps[:, t:t + 1], full_mask[:, :n + 1], position_ids[:, n:n + 1], past)
        assert rel(got[:, 0], want[:, n]) < LOGITS_TOL["float32"], f"decode step {t}"


def _step(session, ids, mask, positions, past):
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), **past}
    if session.positions:
        feeds["position_ids"] = positions.numpy()
    out = dict(zip(session.outputs, session.session.run(None, feeds)))
    return out["logits"], {session.feedback[k]: v for k, v in out.items() if k != "logits"}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers(exported, family):
    """Greedy generation with the state fed back step by step: onnxruntime's tokens are
    transformers' own, and those of transformers on deltarule (`enable()`)."""
    ck, ex = exported(family)
    model = _model(ck)
    prompt = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(2))
    got = DecoderSession(ex.path).greedy(prompt.numpy(), 12, eos_token_id=model.generation_config.eos_token_id)
    for context in (integration.torch_fallback, _enabled):
        with torch.no_grad(), context():
            want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                  do_sample=False, pad_token_id=0)[:, prompt.shape[1]:]
        np.testing.assert_array_equal(got, want.numpy(), err_msg=context.__name__)


@contextlib.contextmanager
def _enabled():
    was = integration.enabled()
    integration.enable()
    try:
        yield
    finally:
        if not was:
            integration.disable()


@pytest.mark.parametrize("family, target", [(f, "ort") for f in FAMILIES] + [("qwen3_5", "onnx"),
                                                                                ("kimi_linear", "onnx")])
def test_deltarule_runner_equals_onnxruntime(exported, family, target):
    """`deltarule.onnx.run` (the linear-attention nodes computed by deltarule) on both targets:
    the same greedy tokens, logits to float32 rounding."""
    _, ex = exported(family, target)
    prompt = torch.randint(3, 256, (2, 5), generator=torch.Generator().manual_seed(3)).numpy()
    ort_session, ours = DecoderSession(ex.path), DecoderSession(ex.path, runner="deltarule")
    np.testing.assert_array_equal(ours.greedy(prompt, 6), ort_session.greedy(prompt, 6))
    mask = np.ones((2, 5), np.int64)
    a, _ = ort_session.step(prompt, mask, ort_session.zero_state(2))
    b, _ = ours.step(prompt, mask, ours.zero_state(2))
    assert rel(b, a) < 5e-6


def test_onnx_target_in_the_reference_evaluator(exported):
    """The opset-27 standard ops in onnx's own ReferenceEvaluator (tiny size: it is slow)."""
    _, ex = exported("qwen3_5", "onnx")
    prompt = np.array([[5, 9, 200]], dtype=np.int64)
    reference, ort_session = DecoderSession(ex.path, runner="reference"), DecoderSession(ex.path)
    np.testing.assert_array_equal(reference.greedy(prompt, 3), ort_session.greedy(prompt, 3))


def test_float16_export(exported):
    """float16 weights and activations (the recurrent state float32): logits within float16
    rounding of transformers' float32 model, and the same greedy tokens as transformers' float16."""
    ck, ex = exported("qwen3_5", "ort", "float16")
    model = onnx.load(ex.path)
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
    assert types["past_recurrent.0"] == onnx.TensorProto.FLOAT
    assert types["past_conv.0"] == types["past_key_values.1.key"] == onnx.TensorProto.FLOAT16
    session = DecoderSession(ex.path)
    prompt = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(4))
    got, _ = session.step(prompt.numpy(), np.ones((2, 6), np.int64), session.zero_state(2))
    with torch.no_grad(), integration.torch_fallback():
        want = _model(ck, torch.float32)(prompt).logits.numpy()
        half = _model(ck, torch.float16)
        tokens = half.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                               pad_token_id=0)[:, prompt.shape[1]:]
    assert rel(got.astype(np.float32), want) < LOGITS_TOL["float16"]
    np.testing.assert_array_equal(session.greedy(prompt.numpy(), 12, eos_token_id=half.generation_config.eos_token_id),
                                  tokens.numpy())


# Target ort-gpu: com.microsoft.GatedDeltaNet (ONNX Runtime's CUDA / WebGPU form), on the CPU EP.
# Its node normalizes q and k with eps 1e-12 where transformers' layers use 1e-6: against
# transformers with its l2norm at the node's epsilon the logits agree as the ort target's do;
# against transformers as it is, within the epsilon's effect (observed 3.5e-5 to 7e-5 here:
# the tiny random models' q / k rows are short; the relative change of a row is ~eps / (2 |x|^2))
GPU_FAMILIES = ["qwen3_5", "qwen3_next", "kimi_linear"]
L2NORM_EPS_TOL = 5e-4


@contextlib.contextmanager
def _l2norm_eps(model, forced: float):
    """transformers' module-level ``l2norm`` of `model`'s family (its torch path normalizes q and
    k with it, eps=1e-6) at eps `forced` while the block runs."""
    import importlib
    module = importlib.import_module(type(model).__module__)
    original = module.l2norm

    def l2norm(x, dim=-1, eps=None):
        return original(x, dim=dim, eps=forced)
    module.l2norm = l2norm
    try:
        yield
    finally:
        module.l2norm = original


@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_ort_gpu_target_is_gated_delta_net_with_fused_gates_and_transformers_logits(exported, family):
    """One com.microsoft.GatedDeltaNet per linear layer, rank-4 q / k / v, the L2 norm, beta's
    sigmoid and (Gated DeltaNet's per-head decay) the gate fused into it: no Softplus left,
    one Sigmoid fewer per layer, fewer nodes than the ort target's graph. In onnxruntime (CPU) a
    padded prefill then decode steps feeding the state back give transformers' logits;
    `deltarule.onnx.run` (the node computed by deltarule) gives onnxruntime's."""
    from deltarule.onnx.export.translate import GATED_DELTA_NET_L2NORM_EPS
    ck, ex = exported(family, "ort-gpu")
    _, ort_ex = exported(family)
    model = onnx.load(ex.path)
    onnx.checker.check_model(model, full_check=True)
    linear = len(ex.layout.linear_layers)
    nodes = [(n.domain, n.op_type) for g in _subgraphs(model.graph) for n in g.node]
    assert nodes.count(("com.microsoft", "GatedDeltaNet")) == linear == ex.ops[("com.microsoft", "GatedDeltaNet")]
    assert nodes.count(("com.microsoft", "CausalConvWithState")) == linear
    assert not [n for n in nodes if n[1] in ("LinearAttention", "Scan", "Loop", "If", "ReduceSumSquare")]
    assert ex.ops[("", "Sigmoid")] == ort_ex.ops[("", "Sigmoid")] - linear
    assert sum(ex.ops.values()) < sum(ort_ex.ops.values())
    kda = family == "kimi_linear"
    for node in (n for n in model.graph.node if n.op_type == "GatedDeltaNet"):
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["qk_l2_norm"] == 1 and attributes["chunk_size"] == 16
        assert attributes["beta_activation"] == b"sigmoid"
        assert attributes["gate_activation"] == (b"none" if kda else b"qwen")
        assert len([x for x in node.input[7:9] if x]) == (0 if kda else 2)
    if not kda:                                   # the decay chain went into the node
        assert ("", "Softplus") not in ex.ops and ort_ex.ops[("", "Softplus")] == linear
    # the recurrent state in and out V-major, the node's layout: no Transpose around the node
    state = {(n.input[6], n.output[1]) for n in model.graph.node if n.op_type == "GatedDeltaNet"}
    assert state == {(f"past_recurrent.{i}", f"present_recurrent.{i}") for i in ex.layout.linear_layers}
    assert ex.ops[("", "Transpose")] == ort_ex.ops[("", "Transpose")]
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in (*model.graph.input, *model.graph.output)}
    ort_dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
                for v in onnx.load(ort_ex.path).graph.input}
    for i in ex.layout.linear_layers:
        b, h, k, v = ort_dims[f"past_recurrent.{i}"]
        assert dims[f"past_recurrent.{i}"] == dims[f"present_recurrent.{i}"] == [b, h, v, k]

    torch_model = _model(ck)
    session = DecoderSession(ex.path)
    ids, mask = _padded_prompts(256, [9, 3, 40])
    steps = torch.randint(3, 256, (3, 3), generator=torch.Generator().manual_seed(1))
    full_ids, full_mask = torch.cat((ids, steps), 1), torch.cat((mask, torch.ones_like(steps)), 1)
    position_ids = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), integration.torch_fallback():
        as_is = torch_model(full_ids, attention_mask=full_mask, position_ids=position_ids).logits.numpy()
        with _l2norm_eps(torch_model, GATED_DELTA_NET_L2NORM_EPS):
            want = torch_model(full_ids, attention_mask=full_mask, position_ids=position_ids).logits.numpy()
    got, past = _step(session, ids, mask, position_ids[:, :ids.shape[1]], session.zero_state(3))
    live = mask.bool().numpy()
    assert rel(got[live], want[:, :ids.shape[1]][live]) < LOGITS_TOL["float32"]
    assert rel(got[live], as_is[:, :ids.shape[1]][live]) < L2NORM_EPS_TOL
    for t in range(steps.shape[1]):
        n = ids.shape[1] + t
        got, past = _step(session, steps[:, t:t + 1], full_mask[:, :n + 1], position_ids[:, n:n + 1], past)
        assert rel(got[:, 0], want[:, n]) < LOGITS_TOL["float32"], f"decode step {t}"
        assert rel(got[:, 0], as_is[:, n]) < L2NORM_EPS_TOL, f"decode step {t}"
    prompt = ids[:2, -5:].numpy()
    ours = DecoderSession(ex.path, runner="deltarule")
    a, _ = session.step(prompt, np.ones((2, 5), np.int64), session.zero_state(2))
    b, _ = ours.step(prompt, np.ones((2, 5), np.int64), ours.zero_state(2))
    assert rel(b, a) < 5e-6


class _GQALayer(torch.nn.Module):
    def forward(self, q, k, v, g, beta):
        return deltarule.linear_attention(q, k, v, g=g, beta=beta)[0]


def test_ort_gpu_refuses_gqa_naming_the_layer_before_converting(monkeypatch):
    """GatedDeltaNet takes value heads a multiple of query heads; more query heads than key /
    value heads (GQA) has no node: refused at export time, naming the layer, before torch.onnx
    runs. The ort target exports the same program."""
    from deltarule.onnx.export.exporter import _check_calls, to_onnx
    B, T, K = 1, 2, 8
    args = (torch.randn(B, T, 4, K), torch.randn(B, T, 2, K), torch.randn(B, T, 2, K), -torch.rand(B, T, 2),
            torch.rand(B, T, 2))
    program = torch.export.export(_Model(_GQALayer()), args, strict=False)
    _check_calls(program, "ort")

    def convert(*args, **kwargs):
        raise AssertionError("converted before the call was checked")
    with monkeypatch.context() as patch:
        patch.setattr(torch.onnx, "export", convert)
        with pytest.raises(deltarule.Unsupported, match=r"layer mixer: GQA \(query heads Hq = 4 above key / value "
                           r"heads Hk = 2, Hv = 2\) has no com.microsoft.GatedDeltaNet node \(target 'ort-gpu'"):
            to_onnx(program, "ort-gpu", inputs=["q", "k", "v", "g", "beta"], outputs=["o"], roles={})


def test_export_copies_the_checkpoint_files(exported):
    ck, ex = exported("qwen3_5")
    import os
    for name in ("config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(ck, name)) and os.path.isfile(os.path.join(ex.directory, name))


def test_bad_arguments_and_unknown_families_are_refused_before_writing(tmp_path, exported):
    ck, _ = exported("qwen3_5")
    out = tmp_path / "out"
    for target in ("tflite", "ort_gpu", "ORT-GPU", "webgpu"):
        with pytest.raises(deltarule.ContractError, match="^target: expected 'ort' \\| 'onnx' \\| 'ort-gpu', got"):
            deltarule.onnx.export.export_model(ck, str(out), target=target)
    with pytest.raises(deltarule.ContractError, match="dtype"):
        deltarule.onnx.export.export_model(ck, str(out), dtype="int8")
    with pytest.raises(deltarule.ContractError, match="model_dir"):
        deltarule.onnx.export.export_model(str(tmp_path / "missing"), str(out))
    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, intermediate_size=64)
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path / "llama")
    with pytest.raises(deltarule.Unsupported, match="'llama' has no linear-attention layers"):
        deltarule.onnx.export.export_model(str(tmp_path / "llama"), str(out))
    assert not out.exists()


class _Layer(torch.nn.Module):
    """One linear-attention call of the form `forward`'s arguments give."""

    def forward(self, q, k, v, g, erase, write, state):
        return deltarule.linear_attention(q, k, v, g=g, erase=erase, write=write, initial_state=state)


class _SlabLayer(torch.nn.Module):
    def forward(self, q, k, v, g, beta, slab, rows):
        return deltarule.linear_attention(q, k, v, g=g, beta=beta, initial_state=slab, state_indices=rows)[0]


class _Model(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.mixer = layer

    def forward(self, *args):
        return self.mixer(*args)


def _gdn2_inputs(B, T, Hk=1, Hv=2, K=8, V=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, Hk, K, generator=g), torch.nn.functional.normalize(torch.randn(B, T, Hk, K, generator=g), dim=-1)
    return (q, k, torch.randn(B, T, Hv, V, generator=g), -torch.rand(B, T, Hv, generator=g),
            torch.rand(B, T, Hv, K, generator=g), torch.rand(B, T, Hv, V, generator=g),
            torch.randn(B, Hv, K, V, generator=g) * 0.1)


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_gated_deltanet2_becomes_ai_deltarule_linear_attention_with_its_body(target):
    """A Gated DeltaNet-2 call (erase / write gates, GVA heads) exports as one
    ``ai.deltarule::LinearAttention`` node carrying its function body: onnxruntime runs the body
    (standard ops), `deltarule.onnx.run` computes the node; both equal the eager call, at a
    batch and length other than the traced ones."""
    from deltarule.onnx.export.exporter import to_onnx
    from deltarule.onnx import run
    import onnxruntime as ort
    batch, seq = torch.export.Dim("batch_size", min=1, max=64), torch.export.Dim("sequence_length", min=2, max=512)
    shapes = tuple({0: batch, 1: seq} for _ in range(6)) + ({0: batch},)
    program = torch.export.export(_Model(_Layer()), _gdn2_inputs(2, 5), dynamic_shapes=(shapes,), strict=False)
    names = ["q", "k", "v", "g", "erase", "write", "state"]
    model = to_onnx(program, target, inputs=names, outputs=["o", "final_state"],
                    roles={("q", 0): "batch_size", ("q", 1): "sequence_length"})
    nodes = [(n.domain, n.op_type) for n in model.graph.node]
    assert nodes.count(("ai.deltarule", "LinearAttention")) == 1 and not [n for n in nodes if n[1] == "Scan"]
    assert [f.domain for f in model.functions] == ["ai.deltarule"]
    x = _gdn2_inputs(3, 7, seed=1)
    want = deltarule.linear_attention(*x[:3], g=x[3], erase=x[4], write=x[5], initial_state=x[6])
    feeds = dict(zip(names, (t.numpy() for t in x)))
    for got in (ort.InferenceSession(model.SerializeToString()).run(None, feeds), run(model, feeds)):
        assert rel(got[0], want[0]) < 1e-5 and rel(got[1], want[1]) < 1e-5


def test_a_call_without_a_node_is_refused_naming_its_layer():
    from deltarule.onnx.export.exporter import _check_calls
    B, T, H, K = 2, 1, 2, 8
    args = (torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, K), -torch.rand(B, T, H),
            torch.rand(B, T, H), torch.zeros(4, H, K, K), torch.tensor([3, 1]))
    program = torch.export.export(_Model(_SlabLayer()), args, strict=False)
    with pytest.raises(deltarule.Unsupported, match=r"layer mixer: a state slab \(state_indices\)"):
        _check_calls(program)


def test_command_line(tmp_path, exported, capsys):
    from deltarule.tools.cli import main
    ck, _ = exported("qwen3_5")
    assert main(["export", "onnx", ck, str(tmp_path / "cli"), "--target", "onnx"]) == 0
    out = capsys.readouterr().out
    assert "1 onnx.LinearAttention" in out and "1 onnx.CausalConvWithState" in out
    assert (tmp_path / "cli" / "onnx" / "model.onnx").is_file()
    assert main(["export", "onnx", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    assert "model_dir" in capsys.readouterr().err


@pytest.mark.parametrize("family", FAMILIES)
def test_genai_config_is_written_for_the_families_genai_runs(exported, family):
    """genai_config.json beside the model for the families onnxruntime-genai 0.18 runs (the
    tokens: tests/test_genai.py, in genai's venv), and the reason where it cannot."""
    import json
    import os
    _, ex = exported(family)
    path = os.path.join(ex.directory, "genai_config.json")
    if family in ("olmo_hybrid", "kimi_linear"):
        assert ex.no_genai_config and "onnxruntime-genai 0.18 cannot run" in ex.no_genai_config
        assert not os.path.exists(path)
    else:
        assert ex.no_genai_config is None
        decoder = json.load(open(path))["model"]["decoder"]
        assert decoder["filename"] == "onnx/model.onnx"
        assert decoder["inputs"]["past_conv_names"] % 0 in ex.inputs
        assert decoder["outputs"]["present_recurrent_names"] % 0 in ex.outputs


def test_a_conditional_generation_checkpoint_gets_transformers_js_text_only_pair(tmp_path):
    """A published Qwen3.5 (Qwen3_5ForConditionalGeneration) is what transformers.js loads
    text-only as embed_tokens + decoder_model_merged (inputs_embeds in): the export writes that
    pair beside model.onnx, and the pair generates transformers' greedy tokens."""
    ck = checkpoints.save_conditional_generation("qwen3_5", str(tmp_path / "ck"))
    ex = deltarule.onnx.export.export_model(ck, str(tmp_path / "out"))
    assert set(ex.text_only) == {"embed_tokens", "decoder_model_merged"}
    merged = onnx.load(ex.text_only["decoder_model_merged"])
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in merged.graph.input}
    assert [v.name for v in merged.graph.input] == ["inputs_embeds", *ex.inputs[1:]]
    assert "position_ids" not in ex.inputs
    assert dims["inputs_embeds"] == ["batch_size", "sequence_length", 128]
    assert [(n.domain, n.op_type) for n in merged.graph.node].count(("com.microsoft", "LinearAttention")) == 1
    model = transformers.AutoModelForCausalLM.from_pretrained(ck).eval()
    prompt = torch.randint(3, 250, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), integration.torch_fallback():
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)[:, prompt.shape[1]:].numpy()
    eos = model.generation_config.eos_token_id
    pair = DecoderSession(ex.text_only["decoder_model_merged"], embed=ex.text_only["embed_tokens"])
    np.testing.assert_array_equal(pair.greedy(prompt.numpy(), 8, eos_token_id=eos), want)
    np.testing.assert_array_equal(DecoderSession(ex.path).greedy(prompt.numpy(), 8, eos_token_id=eos), want)


def test_a_causal_lm_checkpoint_gets_no_text_only_pair(exported):
    _, ex = exported("qwen3_5")
    assert ex.text_only == {}


# The other families `enable()` binds, from tests/test_transformers.py's tiny models (no
# deltarule.tools.bench.checkpoints form): two export and run, two are refused at export time
OTHER_FAMILIES = ["bailing_hybrid", "lara_mini"]
REFUSED = {"qwen4_exp": "torch.export cannot trace transformers' model",
           "glm5_next": "AutoModelForCausalLM does not load"}


def _save_tiny(family, directory):
    from test_transformers import tiny
    model = tiny(family)
    checkpoints.spread_gates(model)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_other_families_export_and_generate_transformers_tokens(tmp_path, family):
    model = _save_tiny(family, tmp_path / "ck")
    ex = deltarule.onnx.export.export_model(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert ex.ops[("com.microsoft", "LinearAttention")] == ex.ops[("com.microsoft", "CausalConvWithState")] == 1
    prompt = torch.randint(3, 120, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), integration.torch_fallback():
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)[:, prompt.shape[1]:]
    got = DecoderSession(ex.path).greedy(prompt.numpy(), 8, eos_token_id=model.generation_config.eos_token_id)
    np.testing.assert_array_equal(got, want.numpy())
    if family == "bailing_hybrid":          # MLA: key and value widths differ
        assert "key and value differ in width" in ex.no_genai_config


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_families_that_do_not_export_are_refused_at_export_time(tmp_path, family):
    _save_tiny(family, tmp_path / "ck")
    with pytest.raises(deltarule.Unsupported, match=REFUSED[family]):
        deltarule.onnx.export.export_model(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_every_family_enable_binds_is_exported_or_refused_here():
    assert set(integration.bindings() and {b.family for b in integration.bindings()}) == \
        set(FAMILIES) | set(OTHER_FAMILIES) | set(REFUSED)


def test_weights_past_the_protobuf_limit_go_to_one_external_file(tmp_path, exported, monkeypatch):
    """Weights past what one protobuf file holds go to ``model.onnx_data`` beside the model (here
    with the limit lowered), which onnxruntime loads, and config.json tells transformers.js so."""
    import json
    from deltarule.onnx.export import exporter
    ck, ex = exported("qwen3_5")
    monkeypatch.setattr(exporter, "EXTERNAL_DATA_BYTES", 1 << 20)
    out = deltarule.onnx.export.export_model(ck, str(tmp_path / "out"))
    assert (tmp_path / "out" / "onnx" / "model.onnx_data").stat().st_size > (1 << 20)
    assert (tmp_path / "out" / "onnx" / "model.onnx").stat().st_size < (1 << 20)
    with open(tmp_path / "out" / "config.json") as f:
        config = json.load(f)
    assert config["transformers.js_config"]["use_external_data_format"] == {"model.onnx": 1}   # the file that has it
    with open(f"{ex.directory}/config.json") as f:           # (below the limit: the config as it was)
        assert "transformers.js_config" not in json.load(f)
    prompt = np.array([[5, 9, 200, 31]], dtype=np.int64)
    np.testing.assert_array_equal(DecoderSession(out.path).greedy(prompt, 4), DecoderSession(ex.path).greedy(prompt, 4))
