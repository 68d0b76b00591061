"""Random-weight checkpoints of the hybrid families, saved locally (no download), for the vLLM
tests and `benchmarks/vllm.py`.

Shapes: ``tiny`` (hidden 128, 2 layers: one Gated DeltaNet, one softmax attention; head dims
64, the smallest vLLM-CPU's kernels take), ``tiny_tp2`` (tiny with every head count even:
tensor parallelism over 2 ranks), ``tiny_0_8b_heads`` (tiny with Qwen3.5-0.8B's linear-attention
heads) and ``qwen3_5_0_8b`` (Qwen3.5-0.8B's text model:
hidden 1024, 24 layers, 3 GDN : 1 attention, 16 key / value heads of 128, vocabulary 248320;
as ``qwen3_next`` with dense MLPs but in the last layer, which vLLM's Qwen3-Next needs to be
MoE: vLLM-CPU imports its Qwen3.5 models only with torchvision, which the benchmark's venv
lacks; docs/vllm.md, "Qwen3.5 and torchvision").
Weights are transformers' random initialisation with a fixed seed; saved in the model's
dtype with ``save_pretrained`` (safetensors), no tokenizer (run with token ids).

``olmo_hybrid`` (tiny only) is rewritten after saving into the names vLLM 0.32's loader reads
and transformers reads too: transformers 5.19's ``save_pretrained`` splits the fused conv
weight back into ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` in three equal parts (wrong when
the value width differs from the key width: 86 / 86 / 84 rows for 64 / 64 / 128), and renames
the norms to ``attention_layer_norm`` / ``feedforward_layer_norm``, which vLLM does not map.
"""

from __future__ import annotations

import os

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear")

_TINY = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=64, intermediate_size=256, layer_types=["linear_attention", "full_attention"],
             linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
             linear_conv_kernel_dim=4, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, tie_word_embeddings=False)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            decoder_sparse_step=1, mlp_only_layers=[])
_0_8B = dict(vocab_size=248320, hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
             num_key_value_heads=2, head_dim=256, intermediate_size=3584,
             layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, linear_num_key_heads=16,
             linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4, max_position_embeddings=32768, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, tie_word_embeddings=True)
# tiny for tensor parallelism over 2 ranks: every head count even (each rank one key head, two value heads)
_TINY_TP2 = dict(_TINY, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4)
# tiny with Qwen3.5-0.8B's linear-attention heads (16 key / value heads of 128): a model whose
# prefill is mostly the recurrence (the web page's fused-vs-Scan comparison, web/models.py)
_TINY_0_8B_HEADS = dict(_TINY, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                        linear_value_head_dim=128)
SHAPES = {"tiny": _TINY, "tiny_tp2": _TINY_TP2, "tiny_0_8b_heads": _TINY_0_8B_HEADS, "qwen3_5_0_8b": _0_8B}


def config(family: str, shape: str = "tiny", *, vocab_size: int | None = None):
    """The transformers config of `family` at `shape` (see the module docstring); `vocab_size`
    overrides the shape's."""
    import transformers
    base = dict(SHAPES[shape])
    if vocab_size is not None:
        base["vocab_size"] = vocab_size
    if family == "qwen3_next":               # at the 0.8B shape dense MLPs as Qwen3.5-0.8B has, but
        moe = _MOE                           # the last layer (vLLM's Qwen3-Next needs one MoE layer)
        if shape == "qwen3_5_0_8b":
            moe = dict(_MOE, moe_intermediate_size=896, shared_expert_intermediate_size=896,
                       mlp_only_layers=list(range(base["num_hidden_layers"] - 1)))
        return transformers.Qwen3NextConfig(**base, **moe, partial_rotary_factor=0.25)
    rope = dict(rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                     mrope_section=[11, 11, 10], mrope_interleaved=True))
    if family == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**base, **rope)
    if family == "olmo_hybrid":
        if shape != "tiny":
            raise ValueError("olmo_hybrid: the tiny shape only")
        return transformers.OlmoHybridConfig(**{k: v for k, v in base.items() if k != "head_dim"})
    if family == "kimi_linear":
        if shape != "tiny":
            raise ValueError("kimi_linear: the tiny shape only")
        # MLA latent 512 + rope 64: the one head size vLLM-CPU's MLA kernels take
        return transformers.KimiLinearConfig(
            vocab_size=base["vocab_size"], hidden_size=base["hidden_size"], num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
            qk_nope_head_dim=64, v_head_dim=64, layer_types=base["layer_types"], mlp_layer_types=["dense", "sparse"],
            intermediate_size=base["intermediate_size"], moe_intermediate_size=64, num_experts=4,
            num_experts_per_token=2, num_expert_group=1, topk_group=1, linear_head_dim=64, linear_num_heads=2,
            linear_conv_kernel_dim=4, max_position_embeddings=base["max_position_embeddings"],
            pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
            rms_norm_eps=1e-5)                # vLLM's KDA output norm has eps 1e-5 whatever the config says
    if family == "qwen3_5_moe":
        moe = {k: v for k, v in _MOE.items() if k not in ("decoder_sparse_step", "mlp_only_layers")}
        return transformers.Qwen3_5MoeTextConfig(**base, **moe, **rope)
    raise ValueError(f"unknown family {family!r}: one of {FAMILIES}")


def save(family: str, directory: str, *, shape: str = "tiny", dtype: str = "float32", seed: int = 0,
         kimi_format: str = "moonshot", vocab_size: int | None = None) -> str:
    """Build `family` at `shape` with random weights (seed) and save it to `directory` in `dtype`;
    an existing checkpoint there is kept. Returns `directory`. `kimi_format` (Kimi Linear only):
    "moonshot" rewrites the checkpoint into Moonshot's format (`_kimi_linear_layout`, what
    Moonshot publishes), "transformers" keeps it as transformers wrote it. `vocab_size`
    overrides the shape's."""
    if kimi_format not in ("moonshot", "transformers"):
        raise ValueError(f"kimi_format: 'moonshot' or 'transformers', not {kimi_format!r}")
    import torch
    import transformers
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    cfg = config(family, shape, vocab_size=vocab_size)
    cfg.architectures = [_ARCH[family]]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    spread_gates(model)
    model.save_pretrained(directory)
    if family == "olmo_hybrid":
        _olmo_hybrid_layout(model, directory)
    if family == "kimi_linear" and kimi_format == "moonshot":
        _kimi_linear_layout(cfg, directory)
    return directory


def save_conditional_generation(family: str, directory: str, *, vocab_size: int | None = None, seed: int = 0) -> str:
    """A tiny Qwen3.5 / Qwen3.5-MoE checkpoint as Qwen publishes them (``...ForConditionalGeneration``:
    a one-block vision tower beside `family`'s tiny text model; random weights, `seed`), saved to
    `directory`. The image / video / vision start / end token ids are the vocabulary's last four.
    Returns `directory`."""
    import torch
    import transformers
    classes = {"qwen3_5": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
               "qwen3_5_moe": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration)}
    if family not in classes:
        raise ValueError(f"{family!r} has no ForConditionalGeneration form here: one of {tuple(classes)}")
    config_class, model_class = classes[family]
    text = config(family, vocab_size=vocab_size).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
    top = text["vocab_size"]
    cfg = config_class(text_config=text, vision_config=vision, image_token_id=top - 4, video_token_id=top - 3,
                       vision_start_token_id=top - 2, vision_end_token_id=top - 1)
    cfg.architectures = [model_class.__name__]
    torch.manual_seed(seed)
    model = model_class(cfg)
    spread_gates(model)
    model.save_pretrained(directory)
    return directory


def spread_gates(model) -> None:
    """Random A_log in [0, 1) and dt_bias in [0, 2), in place: transformers initializes some
    gates at 0 / 1, where every head decays alike."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.rand_like(p, dtype=torch.float32).to(p.dtype) * (1.0 if name.endswith("A_log") else 2.0))


def _kimi_linear_layout(cfg, directory: str) -> None:
    """Rewrite a Kimi Linear checkpoint into Moonshot's format, which vLLM reads (and transformers
    too): the config as the vLLM plugin converts transformers' (`moonshot_kimi_config`: layer
    kinds in ``linear_attn_config`` / ``first_k_dense_replace``, ``mla_use_nope``), dense MLPs
    under ``mlp.`` (transformers saves them as ``block_sparse_moe.``)."""
    import json
    from safetensors.torch import load_file, save_file
    from ...integrations.vllm.kimi import moonshot_kimi_config
    dense = [i for i, kind in enumerate(cfg.mlp_layer_types) if kind == "dense"]
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        c = moonshot_kimi_config(json.load(f))       # (refuses dense layers after sparse ones)
    with open(path, "w") as f:
        json.dump(c, f, indent=2)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    for i in dense:
        old = f"model.layers.{i}.block_sparse_moe."
        tensors = {(k.replace(old, f"model.layers.{i}.mlp.") if k.startswith(old) else k): v for k, v in tensors.items()}
    save_file(tensors, path, metadata={"format": "pt"})


def _olmo_hybrid_layout(model, directory: str) -> None:
    """Rewrite an OLMo-Hybrid checkpoint into the names both vLLM and transformers read (module
    docstring): the conv weight split at the key / value widths, the norms under their model names."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(directory, "model.safetensors")
    tensors = {k.replace("attention_layer_norm", "input_layernorm").replace("feedforward_layer_norm",
                                                                             "post_attention_layernorm"): v
               for k, v in load_file(path).items()}
    for name, p in model.named_parameters():
        if name.endswith("linear_attn.conv1d.weight"):
            layer = model.get_submodule(name[:-len(".conv1d.weight")])
            parts = p.detach().split([layer.key_dim, layer.key_dim, layer.value_dim])
            for which, part in zip("qkv", parts):
                tensors[name.replace("conv1d", f"{which}_conv1d")] = part.contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


_ARCH = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
         "qwen3_5_moe": "Qwen3_5MoeForCausalLM", "olmo_hybrid": "OlmoHybridForCausalLM",
         "kimi_linear": "KimiLinearForCausalLM"}
