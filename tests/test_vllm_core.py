"""The vLLM plugin's parts that need no vLLM: `deltarule.conv` (the short convolution with a
conv-state slab) against its float64 twin, and one GDN core call (`integrations.vllm.core.run_part`)
from a step built out of vLLM-like metadata, checked by the plugin's own shadow mode.
The engine end to end is tests/test_vllm.py (where vllm imports)."""

import json
import types

import pytest
import torch
from torch.nn import Parameter

import deltarule.integrations.vllm as dv
from deltarule.integrations.vllm import core, fixes, kimi, kimi_mla, olmo, qwen
from deltarule.conv import causal_conv1d_slab, plan_conv, reference_conv1d_slab
from deltarule.errors import ContractError
from deltarule.kernels.cpu import conv as cpu_conv

from conftest import rel

SLOTS, C = 9, 24
# (lengths, read rows, write rows, fresh, accepted, columns): plain and rolling layouts
LAYOUTS = {
    "plain-mixed": ([3, 1, 0, 7], [2, 5, 6, 0], [2, 5, 6, 0], [False, False, False, True], None, None),
    "plain-T1-decode": ([1, 1, 1], [4, 1, 8], [4, 1, 8], None, None, None),
    "plain-read-one-write-another": ([2, 2], [3, 4], [4, 3], None, None, None),   # reads before writes
    "plain-padding-rows": ([2, 3], [-1, 7], [-1, 7], None, None, None),
    "rolling-full": ([4, 4], [1, 6], [1, 6], None, [1, 3], 6),
    "rolling-ragged": ([1, 4, 2], [0, 3, 5], [0, 3, 5], None, [2, 4, 1], 6),     # a sequence shorter than accepted
}


def _args(name, dtype, seed=0):
    lengths, read, write, fresh, accepted, columns = LAYOUTS[name]
    g = torch.Generator().manual_seed(seed)
    T, W = sum(lengths), 4
    x = torch.randn(T, C, generator=g).to(dtype)
    weight, bias = torch.randn(C, W, generator=g), torch.randn(C, generator=g)
    S = columns or W - 1 + 1                                 # plain rows one column wider than they need
    slab = torch.randn(SLOTS, C, S, generator=g).to(dtype).transpose(1, 2)   # vLLM's [slots, C, S] memory
    layout = dict(lengths=lengths, read_rows=read, write_rows=write, fresh=fresh, accepted=accepted)
    return x, weight, bias, slab, layout, columns


CONV_BACKENDS = [pytest.param("cpu", marks=pytest.mark.skipif(not cpu_conv.available(), reason="no native kernel")),
                 "torch"]


@pytest.mark.parametrize("backend", CONV_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_conv_matches_float64_twin(name, dtype, backend):
    x, weight, bias, slab, layout, columns = _args(name, dtype)
    before = slab.clone()
    ref_out, ref_slab = reference_conv1d_slab(x, weight, bias, before, activation="silu", **layout)
    plan = plan_conv(layout["lengths"], width=4, read_rows=layout["read_rows"], write_rows=layout["write_rows"],
                     fresh=layout["fresh"], accepted=layout["accepted"], columns=columns)
    out = causal_conv1d_slab(x, weight, bias, slab, plan, activation="silu", backend=backend)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel(out, ref_out) < (1e-6 if dtype == torch.float32 else 8e-3)
    assert torch.equal(slab.double(), ref_slab), "slab columns are copies of inputs: exact"
    written = {r for r in layout["write_rows"] if r >= 0}
    untouched = [r for r in range(SLOTS) if r not in written]
    assert torch.equal(slab[untouched], before[untouched])
    # split outputs (a layer's q, k, v) hold the same values, each part contiguous
    parts = causal_conv1d_slab(x, weight, bias, before.clone(), plan, activation="silu", backend=backend,
                               splits=(5, 7, C - 12))
    assert [tuple(p.shape) for p in parts] == [(x.shape[0], 5), (x.shape[0], 7), (x.shape[0], C - 12)]
    assert all(p.is_contiguous() for p in parts) and torch.equal(torch.cat(parts, dim=1), out)


@pytest.mark.parametrize("name", ["plain-mixed", "plain-read-one-write-another", "rolling-ragged"])
def test_cpu_conv_threads_do_not_change_a_bit(monkeypatch, cpu_threads, name):
    """The cpu form's (sequence, block of 512 channels) tasks on 3 threads (torch's OpenMP pool;
    with own threads the conv runs on the caller alone) give the bits of one thread, and the
    float64 twin's values: 1100 channels make 3 blocks per sequence."""
    if not cpu_conv.available():
        pytest.skip("no native kernel")
    lengths, read, write, fresh, accepted, columns = LAYOUTS[name]
    g = torch.Generator().manual_seed(1)
    x, weight, bias = torch.randn(sum(lengths), 1100, generator=g), torch.randn(1100, 4, generator=g), None
    slab = torch.randn(SLOTS, 1100, columns or 4, generator=g).transpose(1, 2)
    plan = plan_conv(lengths, width=4, read_rows=read, write_rows=write, fresh=fresh, accepted=accepted,
                     columns=columns)
    one = slab.clone()
    out1 = causal_conv1d_slab(x, weight, bias, one, plan, backend="cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(cpu_conv, "ELEMENTS_PER_THREAD", 1)
    three = slab.clone()
    out3 = causal_conv1d_slab(x, weight, bias, three, plan, backend="cpu")
    assert torch.equal(out1, out3) and torch.equal(one, three)
    ref_out, ref_slab = reference_conv1d_slab(x, weight, bias, slab, activation="silu", lengths=lengths,
                                              read_rows=read, write_rows=write, fresh=fresh, accepted=accepted)
    assert rel(out3, ref_out) < 1e-6 and torch.equal(three.double(), ref_slab)


@pytest.mark.parametrize("backend", CONV_BACKENDS)
def test_conv_writes_into_a_given_workspace(backend):
    """`out=`: the split outputs are views of the caller's buffer, one part after the other,
    equal to the allocated ones; the rest of the buffer stays as it was."""
    x, weight, bias, slab, layout, columns = _args("plain-mixed", torch.bfloat16)
    plan = plan_conv(layout["lengths"], width=4, read_rows=layout["read_rows"], write_rows=layout["write_rows"],
                     fresh=layout["fresh"])
    want = causal_conv1d_slab(x, weight, bias, slab.clone(), plan, backend=backend, splits=(5, 7, C - 12))
    T = x.shape[0]
    buf = torch.full((T * C + 9,), 7.0, dtype=x.dtype)
    got = causal_conv1d_slab(x, weight, bias, slab.clone(), plan, backend=backend, splits=(5, 7, C - 12), out=buf)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert got[0].data_ptr() == buf.data_ptr() and got[2].data_ptr() == buf[12 * T:].data_ptr()
    assert torch.equal(buf[T * C:], torch.full((9,), 7.0, dtype=x.dtype))


@pytest.mark.parametrize("bad, match", [
    (lambda x: torch.empty(x.numel() - 1, dtype=x.dtype), r"^out: .*>= "),
    (lambda x: torch.empty(x.numel(), dtype=torch.float32), r"^out: .*bfloat16"),
    (lambda x: torch.empty(2, x.numel(), dtype=x.dtype)[:, 0], r"^out: .*contiguous 1-D"),
    (lambda x: x.view(-1), r"^out: .*x shares its memory"),
])
def test_conv_refuses_a_bad_workspace(bad, match):
    x, weight, bias, slab, layout, columns = _args("plain-mixed", torch.bfloat16)
    plan = plan_conv(layout["lengths"], width=4, read_rows=layout["read_rows"], write_rows=layout["write_rows"],
                     fresh=layout["fresh"])
    before = slab.clone()
    with pytest.raises(ContractError, match=match):
        causal_conv1d_slab(x, weight, bias, slab, plan, out=bad(x))
    assert torch.equal(slab, before), "nothing written on failure"


@pytest.mark.parametrize("backend", CONV_BACKENDS)
def test_conv_sees_weights_changed_in_place(backend):
    """The cpu form keeps a layer's converted taps: an in-place update must not go unseen."""
    x, weight, bias, slab, layout, columns = _args("plain-mixed", torch.float32)
    plan = plan_conv(layout["lengths"], width=4, read_rows=layout["read_rows"], write_rows=[-1] * 4,
                     fresh=layout["fresh"])
    first = causal_conv1d_slab(x, weight, bias, slab, plan, backend=backend)
    weight.mul_(2)
    bias.mul_(2)
    ref, _ = reference_conv1d_slab(x, weight, bias, slab, activation="silu", **dict(layout, write_rows=[-1] * 4))
    second = causal_conv1d_slab(x, weight, bias, slab, plan, backend=backend)
    assert rel(second, ref) < 1e-6 and rel(first, ref) > 0.1


@pytest.mark.parametrize("over, match", [
    (dict(accepted=[1, 5]), r"^accepted: .*\[1, 4\]"),
    (dict(lengths=[4, 5]), r"^lengths: .*<= 4"),
    (dict(width=1), r"^width: .*>= 2 with the rolling"),
    (dict(read_rows=[1]), r"^read_rows / write_rows: .*2 rows"),
])
def test_plan_conv_refuses(over, match):
    args = dict(lengths=[4, 4], width=4, read_rows=[1, 6], write_rows=[1, 6], accepted=[1, 3], columns=6)
    with pytest.raises(ContractError, match=match):
        plan_conv(**{**args, **over})


def _metadata(spec: bool):
    """vLLM's GDNAttentionMetadata fields the plugin reads: 2 decodes + 2 prefills (one without a
    prior state), and with `spec` 2 more requests verifying draft tokens."""
    t = lambda *v: torch.tensor(v, dtype=torch.int32)   # noqa: E731
    m = types.SimpleNamespace(num_decodes=2, num_prefills=2, num_decode_tokens=2, num_prefill_tokens=9,
                              num_spec_decodes=0, num_actual_tokens=11, spec_sequence_masks=None,
                              non_spec_query_start_loc=t(0, 1, 2, 6, 11), non_spec_state_indices_tensor=t(3, 0, 5, 7),
                              has_initial_state=torch.tensor([True, True, True, False]), non_spec_token_indx=None)
    if spec:
        m.spec_sequence_masks = torch.tensor([True, True, False, False, False, False])
        m.num_spec_decodes = 2
        m.spec_query_start_loc = t(0, 4, 5)
        m.spec_state_indices_tensor = t(1, 2, 4, 6, 8, 10, 11, 12).view(2, 4)
        m.num_accepted_tokens = t(2, 3)
        m.spec_token_indx = torch.tensor([0, 1, 2, 3, 4])
        m.non_spec_token_indx = torch.arange(5, 16)
        m.num_actual_tokens = 16
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("spec", [False, True], ids=["prefill-decode", "with-speculative"])
@pytest.mark.parametrize("family", ["qwen", "olmo", "kimi", "kimi-bounded"])
def test_core_call_matches_float64(family, spec, dtype, tmp_path, monkeypatch):
    """The layer's core on the plugin's step (Qwen3.5's strided b / a views included), against
    float64 twins of the convolution and of the recurrence (the shadow check). OLMo-Hybrid's
    core: no conv bias, beta = 2 sigmoid(b) (allow_neg_eigval); Kimi Linear's: per-key raw gate
    [T, Hv, K] with dt_bias [Hv K], raw or bounded (gate_lower_bound)."""
    Hk, Hv, K, V, W = 2, 4, 16, 8, 4
    g = torch.Generator().manual_seed(1)
    m = _metadata(spec)
    slots, S = 16, W - 1 + (3 if spec else 0)
    Cd = 2 * Hk * K + Hv * V
    bias = torch.randn(Cd, generator=g) if family == "qwen" else None
    layer = types.SimpleNamespace(prefix="model.layers.0.linear_attn", activation="silu",
                                  conv1d=types.SimpleNamespace(bias=bias), allow_neg_eigval=True,
                                  A_log=Parameter(torch.rand(Hv, generator=g), requires_grad=False),
                                  dt_bias=Parameter(torch.randn(Hv, generator=g), requires_grad=False),
                                  gate_lower_bound=-5.0 if family == "kimi-bounded" else None)
    gates = {"qwen": qwen.qwen_gates, "olmo": olmo.olmo_gates}.get(family, kimi.kimi_gates)
    if family.startswith("kimi"):
        layer.dt_bias = Parameter(torch.randn(Hv * K, generator=g), requires_grad=False)
    weight = torch.randn(Cd, W, generator=g)
    conv_state = torch.randn(slots, Cd, S, generator=g).to(dtype).transpose(1, 2)
    ssm = torch.randn(slots, Hv, K, V, generator=g) * 0.1
    n = m.num_actual_tokens
    mixed_qkv = torch.randn(n, Cd, generator=g).to(dtype)
    ba = torch.randn(n, 2 * Hv, generator=g).to(dtype)
    b, a = ba.chunk(2, dim=-1)                               # Qwen3.5's layout: strided views
    if family.startswith("kimi"):
        a = torch.randn(n, Hv, K, generator=g).to(dtype)
    out = torch.full((n, Hv, V), float("nan"), dtype=dtype)
    shadow = tmp_path / "shadow.jsonl"
    monkeypatch.setenv(dv.SHADOW_ENV, str(shadow))
    ssm_before = ssm.clone()
    slabs = dv.Slabs(conv_state, ssm, weight)
    step = dv.step_of(m, width=W, columns=S, slots=slots)
    assert len(step.parts) == (2 if spec else 1)
    assert dv.step_of(m, width=W, columns=S, slots=slots) is step      # built once per step
    for _ in range(2):                  # the second time: the parts' kept launches (decode steps' path)
        for part in step.parts:
            core.run_part(layer, part, mixed_qkv, b, a, out, slabs, gates)
    assert not out.isnan().any(), "a token's output was never written"
    # parts of the step's first tokens keep their launches; gathered ones (beside speculative) do not
    assert [bool(part.kept) for part in step.parts] == [part.tokens is None for part in step.parts]
    for kept in (part.kept[id(layer)] for part in step.parts if part.tokens is None):
        assert not kept.launch.copy                          # the gates' contiguous copies, not strided views
        # gates that are views of the raw gates or the layer's parameters are made once, others per call
        assert (kept.args is not None) == (family == "qwen"), family
    records = [json.loads(line) for line in shadow.read_text().splitlines()]
    assert len(records) == 2 * len(step.parts) and all(r["ok"] for r in records), records
    assert ssm[7].abs().sum() > 0                            # the fresh sequence stored its state
    untouched = [r for r in range(slots) if r not in {3, 0, 5, 7} | ({1, 2, 4, 6, 8} if spec else set())]
    assert torch.equal(ssm[untouched], ssm_before[untouched])


def test_olmo_conv_loader_takes_the_shard_from_the_tensor():
    """OLMo-Hybrid's fused conv weight loader (vLLM 0.32 passes the shard index as the weight's
    `shard_id` attribute, its loader wants an argument): each shard lands at its offset."""
    def make_loader(dims, tp_size, tp_rank):            # vLLM's loader factory's behaviour
        def weight_loader(param, loaded_weight, loaded_shard_id=None):
            offset = sum(dims[:loaded_shard_id])
            param[offset:offset + dims[loaded_shard_id]] = loaded_weight
        return weight_loader

    load = olmo._shard_from_tensor(make_loader)([2, 2, 3], 1, 0)
    param = torch.zeros(7, 1, 4)
    for shard, rows in enumerate([2, 2, 3]):
        w = torch.full((rows, 1, 4), float(shard + 1))
        w.shard_id = shard
        load(param, w)
    assert param[:, 0, 0].tolist() == [1, 1, 2, 2, 3, 3, 3]
    explicit = torch.full((3, 1, 4), 9.0)
    load(param, explicit, 2)                              # an argument still wins
    assert param[4:, 0, 0].tolist() == [9, 9, 9]


def test_kimi_mla_cache_epilogues_torch_forms():
    """The torch forms of Kimi's CUDA-only MLA epilogues (used where vLLM's `_C` lacks them):
    the full key per head, the decode query, the latent of each token in its paged-cache slot
    (padding slots -1 write nothing, other slots keep their bits)."""
    g = torch.Generator().manual_seed(3)
    T, H, P, L, R = 3, 2, 4, 6, 2
    k_nope, q = torch.randn(T, H, P, generator=g), torch.randn(T, H, P + R, generator=g)
    k_pe, kv_c = torch.randn(T, 1, R, generator=g), torch.randn(T, L, generator=g)
    cache = torch.randn(3, 4, L + R, generator=g)
    before = cache.clone()
    slots = torch.tensor([5, -1, 10])
    k = kimi_mla.mla_key_concat_cache_insert(q, k_nope, k_pe, kv_c, cache, slots)
    assert torch.equal(k[:, :, :P], k_nope) and torch.equal(k[:, :, P:], k_pe.expand(T, H, R))
    rows, old = cache.view(-1, L + R), before.view(-1, L + R)
    assert torch.equal(rows[5], torch.cat([kv_c[0], k_pe[0, 0]]))
    assert torch.equal(rows[10], torch.cat([kv_c[2], k_pe[2, 0]]))
    others = [r for r in range(12) if r not in (5, 10)]
    assert torch.equal(rows[others], old[others])
    ql, q_pe = torch.randn(T, H, L, generator=g), torch.randn(T, H, R, generator=g)
    mqa_q = kimi_mla.mla_decode_q_concat_cache_insert(ql, q_pe, kv_c, k_pe[:, 0], cache, torch.tensor([0, 1, 2]))
    assert torch.equal(mqa_q, torch.cat([ql, q_pe], dim=-1))
    assert torch.equal(rows[:3], torch.cat([kv_c, k_pe[:, 0]], dim=-1))
    with pytest.raises(NotImplementedError):
        kimi_mla.mla_key_concat_cache_insert(q, k_nope, k_pe, kv_c, cache, slots, positions=torch.arange(T))


def test_kimi_mla_gather_cache_torch_form():
    """The torch form of `gather_and_maybe_dequant_cache` (chunked-context MLA prefill): token i of
    the chunk reads its sequence's cached latent at (seq_start +) i - cu_seq_lens[seq]."""
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(6, 4, 5, generator=g)                    # [blocks, block size, latent]
    block_table = torch.tensor([[3, 1, 0], [5, 2, 4]])
    cu_seq_lens, token_to_seq = torch.tensor([0, 3, 9]), torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1])
    dst = torch.full((12, 5), float("nan"))
    kimi_mla.OpsWithGather.gather_and_maybe_dequant_cache(cache, dst, block_table, cu_seq_lens, token_to_seq, 9,
                                                           "auto", None, seq_starts=torch.tensor([4, 0]))
    flat = lambda seq, pos: cache[block_table[seq, pos // 4], pos % 4]          # noqa: E731
    want = [flat(0, 4 + i) for i in range(3)] + [flat(1, i) for i in range(6)]
    assert torch.equal(dst[:9], torch.stack(want)) and dst[9:].isnan().all()
    with pytest.raises(NotImplementedError):
        kimi_mla.OpsWithGather.gather_and_maybe_dequant_cache(cache, dst, block_table, cu_seq_lens, token_to_seq, 9,
                                                               "fp8", None)


TRANSFORMERS_KIMI = dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                         mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_num_heads=4,
                         linear_head_dim=64, linear_conv_kernel_dim=4, kv_lora_rank=512)


def test_kimi_config_in_transformers_format_converted():
    """A Kimi Linear config.json as transformers writes it, read as Moonshot's format: 1-based
    layer lists, the KDA sizes, the dense-first count, NoPE MLA; the other fields kept."""
    got = kimi.moonshot_kimi_config(dict(TRANSFORMERS_KIMI))
    assert got["linear_attn_config"] == dict(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=4, head_dim=64,
                                             short_conv_kernel_size=4)
    assert got["first_k_dense_replace"] == 1 and got["mla_use_nope"] is True and got["kv_lora_rank"] == 512
    given = dict(TRANSFORMERS_KIMI, linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=4,
                                                            head_dim=64, short_conv_kernel_size=4),
                 first_k_dense_replace=1)
    assert kimi.moonshot_kimi_config(given)["linear_attn_config"] == got["linear_attn_config"]


def test_kimi_config_in_moonshot_format_kept():
    moonshot = dict(TRANSFORMERS_KIMI, mla_use_nope=False)        # Moonshot's flag given: not touched
    assert kimi.moonshot_kimi_config(moonshot) == moonshot
    assert kimi.moonshot_kimi_config({"num_hidden_layers": 2}) == {"num_hidden_layers": 2}


@pytest.mark.parametrize("change,match", [
    (dict(mlp_layer_types=["dense", "sparse", "dense", "sparse"]), "dense MLPs only in the first layers"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     "sliding_attention"),
    (dict(linear_num_heads=None), "num_heads"),
], ids=["dense-after-sparse", "unknown-layer-kind", "no-kda-heads"])
def test_kimi_config_vllm_cannot_express_refused(change, match):
    fields = {k: v for k, v in dict(TRANSFORMERS_KIMI, **change).items() if v is not None}
    with pytest.raises(ValueError, match=match):
        kimi.moonshot_kimi_config(fields)


def test_kimi_dense_mlp_weights_renamed():
    """transformers saves a dense layer's MLP under block_sparse_moe.; vLLM's dense layers read mlp.
    (sparse layers keep their names; extra tuple fields pass through)."""
    dense, sparse = types.SimpleNamespace(mlp=None), types.SimpleNamespace(block_sparse_moe=None, mlp=None)
    model = types.SimpleNamespace(model=types.SimpleNamespace(layers=[dense, sparse]))
    w = torch.zeros(1)
    names = [("model.layers.0.block_sparse_moe.gate_proj.weight", w),
             ("model.layers.1.block_sparse_moe.experts.0.w1.weight", w, {"x": 1}),
             ("model.layers.0.self_attn.q_proj.weight", w), ("lm_head.weight", w)]
    got = list(kimi._dense_mlp_names(model, iter(names)))
    assert [g[0] for g in got] == ["model.layers.0.mlp.gate_proj.weight", names[1][0], names[2][0], names[3][0]]
    assert got[1][2] == {"x": 1} and all(g[1] is w for g in got)


class _NoMapping:
    """Answers every attribute, ``__dict__`` too, with a non-mapping (as llvmlite's ``ffi.lib``)."""

    def __getattr__(self, name):
        return lambda *args: None


def test_kernel_scan_rebinds_and_survives_objects_without_a_mapping(monkeypatch):
    """The plugin's form of vLLM's kernel scan: module copies of a kernel and warmup owners'
    `kernel` (instance: cached arg names dropped; class) point at the wrapper; a module holding
    an object whose __dict__ is no mapping is scanned past (vLLM's scan raised there)."""
    def kernel():
        pass

    def wrapper():
        pass

    class Owner:
        kernel = None

    instance = types.SimpleNamespace(kernel=kernel, _kernel_arg_names=("a",))
    Owner.kernel = kernel
    module = types.ModuleType("deltarule_test_scan")
    module.copy, module.instance, module.Owner, module.lib = kernel, instance, Owner, _NoMapping()
    monkeypatch.setitem(__import__("sys").modules, module.__name__, module)
    fixes.rebind_kernels([(kernel, wrapper)])
    assert module.copy is wrapper and instance.kernel is wrapper and Owner.kernel is wrapper
    assert not hasattr(instance, "_kernel_arg_names")


def test_linear_heads_that_tensor_parallelism_cannot_divide_refused():
    def config(tp, **fields):
        return types.SimpleNamespace(parallel_config=types.SimpleNamespace(tensor_parallel_size=tp),
                                     model_config=types.SimpleNamespace(hf_text_config=types.SimpleNamespace(**fields)))
    fixes.check_linear_heads(config(2, linear_num_key_heads=2, linear_num_value_heads=4))
    fixes.check_linear_heads(config(1, linear_num_key_heads=1, linear_num_value_heads=3))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide linear_num_key_heads=1"):
        fixes.check_linear_heads(config(2, linear_num_key_heads=1, linear_num_value_heads=2))
    with pytest.raises(ValueError, match=r"linear_attn_config.num_heads=3"):
        fixes.check_linear_heads(config(2, linear_attn_config={"num_heads": 3}))


def _platform_config(architecture, *, dtype=torch.bfloat16, tp=1):
    """The vLLM config fields the platform check's fixes read (a hybrid model whose mamba cache
    was aligned to prefix caching: 128-token mamba blocks)."""
    model = types.SimpleNamespace(architectures=[architecture], max_model_len=512, dtype=dtype,
                                  hf_config=types.SimpleNamespace(model_type="kimi_linear"),
                                  hf_text_config=types.SimpleNamespace(linear_num_key_heads=1))
    return types.SimpleNamespace(model_config=model, attention_config=types.SimpleNamespace(backend=None),
                                 parallel_config=types.SimpleNamespace(tensor_parallel_size=tp),
                                 cache_config=types.SimpleNamespace(enable_prefix_caching=True, mamba_block_size=128,
                                                                    mamba_cache_mode="align"))


def _prefix_caching_off(config):
    """vLLM-CPU's config check for an MLA model on a CPU without AMX: prefix caching off."""
    config.cache_config.enable_prefix_caching = False


def test_config_fixes_run_only_for_their_architectures():
    """The platform check runs a family's config fixes only where the config names one of its
    architectures: Kimi Linear's finishes the prefix-caching switch (one mamba block of
    max_model_len, cache mode "none"); the same config under another architecture is left as
    vLLM's check leaves it. The tensor-parallel head check runs for every model."""
    from deltarule.integrations.vllm import FAMILIES
    kimi_config = _platform_config("KimiLinearForCausalLM")
    fixes.check_config(kimi_config, _prefix_caching_off, FAMILIES)
    assert vars(kimi_config.cache_config) == dict(enable_prefix_caching=False, mamba_block_size=512,
                                                  mamba_cache_mode="none")
    other = _platform_config("Qwen3NextForCausalLM")
    fixes.check_config(other, _prefix_caching_off, FAMILIES)
    assert vars(other.cache_config) == dict(enable_prefix_caching=False, mamba_block_size=128, mamba_cache_mode="align")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide linear_num_key_heads=1"):
        fixes.check_config(_platform_config("Qwen3NextForCausalLM", tp=2), _prefix_caching_off, FAMILIES)


def test_every_family_in_one_table_and_the_core_imports_none():
    """The plugin walks one table; the core's modules import no family (no import cycle)."""
    import ast
    import pathlib
    from deltarule.integrations.vllm import FAMILIES
    assert {f.name for f in FAMILIES} == {"Qwen3-Next / Qwen3.5", "OLMo-Hybrid", "Kimi Linear"}
    architectures = [a for f in FAMILIES for a in f.architectures]
    assert len(architectures) == len(set(architectures))
    families = {"qwen", "olmo", "kimi", "kimi_mla", "families", "fixes"}
    for name in ("steps", "core", "shadow", "post_import"):
        tree = ast.parse(pathlib.Path(core.__file__).with_name(f"{name}.py").read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1
                    for a in n.names} | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                                         and n.level == 1 and n.module}
        assert not imported & families, (name, imported & families)
