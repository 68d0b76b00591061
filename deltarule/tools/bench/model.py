"""`deltarule bench --model FAMILY`: a transformers hybrid model end to end, with and without deltarule.

A random-weight model of realistic layer sizes (`MODELS`; nothing is downloaded)
runs a prefill (one forward of T tokens with a cache, logits of the last token
only, as `generate` does) and a greedy `generate` of a short prompt, twice:
on transformers' PyTorch fallback (`torch_fallback()`: also where fla is
installed, whose GPU kernels fail on a CPU) and on deltarule (`enable()`).

Besides tokens/s it reports where the time goes: the share spent inside the
linear-attention layers (forward hooks on the modules whose forward calls the
bound recurrence, projections and convolution included), the share inside the
recurrence calls themselves, and decode's time per recurrence call, which is
the per-layer call overhead a decode step pays once per linear layer. Decode
steps are timed from inside `generate` (a logits processor stamps each step), so
the prefill is not subtracted out of a total.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import statistics
import time
import warnings
from dataclasses import dataclass

import torch

from ...errors import Unsupported
from . import report

# Sizes: per family, the layers of a public checkpoint with fewer of them.
MODELS = {
    # Qwen3.5-0.8B's layers (hidden 1024, 16 GDN heads of 128, 3 linear : 1 full attention,
    # vocabulary 248320, tied embeddings), 8 of its 24 layers: 6 linear, 2 full attention.
    "qwen3_5": dict(
        config="Qwen3_5TextConfig", model="Qwen3_5ForCausalLM",
        kwargs=dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                    linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True)),
    # Qwen3-Next-80B-A3B's layers (hidden 2048, 16 key / 32 value GDN heads of 128, MoE with
    # 512-wide experts, 10 routed of them and a shared one), 4 layers: 3 linear, 1 full; 32 experts.
    "qwen3_next": dict(
        config="Qwen3NextConfig", model="Qwen3NextForCausalLM",
        kwargs=dict(vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=4,
                    layer_types=["linear_attention"] * 3 + ["full_attention"],
                    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=32,
                    num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512)),
    # Kimi-Linear-48B-A3B's layers (hidden 2304, 32 KDA heads of 128, MLA attention, MoE with
    # 1024-wide experts, 8 routed), 4 layers: 3 KDA, 1 MLA; 32 experts.
    "kimi_linear": dict(
        config="KimiLinearConfig", model="KimiLinearForCausalLM",
        kwargs=dict(vocab_size=163840, hidden_size=2304, intermediate_size=9216, num_hidden_layers=4,
                    layer_types=["linear_attention"] * 3 + ["full_attention"],
                    num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None,
                    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, linear_num_heads=32,
                    linear_head_dim=128, linear_conv_kernel_dim=4, num_local_experts=32, num_experts_per_tok=8,
                    moe_intermediate_size=1024, first_k_dense_replace=1, n_group=1, topk_group=1,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}
# (prefill tokens, prompt tokens, new tokens): the measurement, and --quick.
SIZES = {"full": (2048, 256, 32), "quick": (512, 64, 16)}


@dataclass
class _Clock:
    """Seconds spent in the linear-attention layers and in the recurrence calls, and the calls."""

    layers: float = 0.0
    calls: int = 0
    recurrence: float = 0.0

    def reset(self):
        self.layers, self.calls, self.recurrence = 0.0, 0, 0.0


def build(family: str) -> torch.nn.Module:
    import transformers

    spec = MODELS[family]
    config = getattr(transformers, spec["config"])(**spec["kwargs"])
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, spec["model"])(config).eval()


def run(args: argparse.Namespace) -> dict:
    import deltarule.integrations.transformers as dt

    family = args.model
    prefill_tokens, prompt_tokens, new_tokens = SIZES["quick" if args.quick else "full"]
    enabled = dt.enable()
    if family not in enabled.families:
        dt.disable()
        raise Unsupported(f"bench --model {family}: deltarule cannot bind this family in the installed "
                          f"transformers: {enabled.left.get(family, 'it binds none of fla kernels')}")
    recurrences = [b for b in enabled.bound if b.kernel in dt.FLA_KERNELS]
    try:
        model = build(family)
        layers = _linear_layers(model, recurrences)
        clock = _Clock()
        with _timed_layers(layers, clock):
            gen = torch.Generator().manual_seed(0)
            vocab = model.config.vocab_size
            prefill_ids = torch.randint(3, vocab, (1, prefill_tokens), generator=gen)
            prompt = torch.randint(3, vocab, (1, prompt_tokens), generator=gen)
            results = {}
            for mode in ("fallback", "deltarule"):
                with dt.torch_fallback() if mode == "fallback" else contextlib.nullcontext(), \
                        _timed_recurrences(model, recurrences, clock):
                    results[mode] = _measure(model, prefill_ids, prompt, new_tokens, clock, args)
    finally:
        dt.disable()
    a, b = results["fallback"], results["deltarule"]
    if not torch.equal(a.pop("tokens"), b.pop("tokens")):
        raise AssertionError(f"{family}: greedy tokens differ between the fallback and deltarule")
    return {"family": family, "parameters": sum(p.numel() for p in model.parameters()),
            "linear_layers": len(layers), "layers": model.config.num_hidden_layers,
            "prefill_tokens": prefill_tokens, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "fallback": a, "deltarule": b}


def _measure(model, prefill_ids, prompt, new_tokens, clock, args) -> dict:
    """Prefill and decode times (medians over --repeat runs) and the shares of the linear layers."""
    prefills, decodes = [], []
    for _ in range(max(1, min(args.repeat, 3))):
        clock.reset()
        start = time.perf_counter()
        with torch.no_grad():
            model(prefill_ids, use_cache=True, logits_to_keep=1)
        prefills.append((time.perf_counter() - start, clock.layers, clock.recurrence))
        stamps = []
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0, logits_processor=[_Stamp(stamps, clock)])
        # stamps[0]: after the prompt's prefill; each later one closes one decode step
        steps = [(t1 - t0, l1 - l0, r1 - r0, c1 - c0) for (t0, l0, r0, c0), (t1, l1, r1, c1)
                 in zip(stamps, stamps[1:])]
        decodes.append(steps)
    prefill = min(prefills)
    decode = sorted(decodes, key=lambda steps: sum(s[0] for s in steps))[len(decodes) // 2]
    step_time = statistics.median(s[0] for s in decode)
    calls = sum(s[3] for s in decode)
    return {
        "tokens": out,
        "prefill_s": prefill[0], "prefill_tok_s": prefill_ids.shape[1] / prefill[0],
        "prefill_linear_share": prefill[1] / prefill[0], "prefill_recurrence_share": prefill[2] / prefill[0],
        "decode_step_ms": step_time * 1e3, "decode_tok_s": 1 / step_time,
        "decode_linear_share": sum(s[1] for s in decode) / sum(s[0] for s in decode),
        "decode_recurrence_share": sum(s[2] for s in decode) / sum(s[0] for s in decode),
        "decode_call_us": 1e6 * sum(s[2] for s in decode) / max(calls, 1),
        "decode_layer_us": 1e6 * sum(s[1] for s in decode) / max(calls, 1),
    }


class _Stamp:
    """A logits processor that records (time, layer seconds, recurrence seconds, calls) per step."""

    def __init__(self, stamps: list, clock: _Clock):
        self.stamps, self.clock = stamps, clock

    def __call__(self, input_ids, scores):
        c = self.clock
        self.stamps.append((time.perf_counter(), c.layers, c.recurrence, c.calls))
        return scores


def _linear_layers(model, recurrences) -> list[torch.nn.Module]:
    """The modules whose forward calls one of the bound recurrences (the linear-attention layers)."""
    names = {b.attribute for b in recurrences}
    return [m for m in model.modules() if names & set(inspect.unwrap(type(m).forward).__code__.co_names)]


@contextlib.contextmanager
def _timed_layers(layers, clock: _Clock):
    """Time the linear-attention layers: forward hooks around each of them."""
    starts = {}

    def before(module, args):
        starts[id(module)] = time.perf_counter()

    def after(module, args, output):
        clock.layers += time.perf_counter() - starts.pop(id(module))

    handles = []
    for layer in layers:
        handles += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _timed_recurrences(model, recurrences, clock: _Clock):
    """Time the recurrence calls: whatever the current mode bound, wrapped while the block runs."""
    module = importlib.import_module(type(model).__module__)
    bound = {b.attribute: getattr(module, b.attribute) for b in recurrences if b.module == module.__name__}

    def timed(function):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                clock.recurrence += time.perf_counter() - start
                clock.calls += 1
        return call

    for attribute, function in bound.items():
        setattr(module, attribute, timed(function))
    try:
        yield
    finally:
        for attribute, function in bound.items():
            setattr(module, attribute, function)


def table(result: dict, meta: dict) -> str:
    """The side-by-side table: fallback, deltarule, and their ratio (fallback time / deltarule time)."""
    a, b = result["fallback"], result["deltarule"]
    pct = lambda x: f"{100 * x:.0f} %"  # noqa: E731
    rows = [["", "", "fallback", "deltarule", "speed-up"]]

    def line(name, unit, key, fmt, faster=None):
        ratio = "" if faster is None else f"{faster(a[key], b[key]):.2f}x"
        rows.append([name, unit, fmt(a[key]), fmt(b[key]), ratio])

    rate = lambda x, y: y / x  # noqa: E731
    per_time = lambda x, y: x / y  # noqa: E731
    line(f"prefill T = {result['prefill_tokens']}", "tok/s", "prefill_tok_s", lambda x: f"{x:.0f}", rate)
    line("  in linear-attention layers", "share", "prefill_linear_share", pct)
    line("  in the recurrence calls", "share", "prefill_recurrence_share", pct)
    line(f"decode ({result['prompt_tokens']} + {result['new_tokens']} tokens)", "tok/s", "decode_tok_s",
         lambda x: f"{x:.1f}", rate)
    line("  per step", "ms", "decode_step_ms", lambda x: f"{x:.1f}", per_time)
    line("  in linear-attention layers", "share", "decode_linear_share", pct)
    line("  in the recurrence calls", "share", "decode_recurrence_share", pct)
    line("  per linear layer and step", "us", "decode_layer_us", lambda x: f"{x:.0f}", per_time)
    line("  per recurrence call", "us", "decode_call_us", lambda x: f"{x:.0f}", per_time)
    head = (f"deltarule {meta['deltarule']} bench --model {result['family']}: {MODELS[result['family']]['model']}, "
            f"{result['layers']} layers ({result['linear_layers']} linear-attention), "
            f"{result['parameters'] / 1e6:.0f}M parameters, random weights, float32; torch {meta['torch']}, "
            f"transformers {meta['peers']['transformers']}, {meta['threads']} threads")
    notes = ["prefill: one forward with a cache, logits of the last token (best of the runs); decode: greedy "
             "generate, median step (the run of median total)",
             "fallback: transformers' own PyTorch functions; the greedy tokens of the two runs are equal",
             "shares: time inside the linear-attention modules (projections and convolution included) and "
             "inside the recurrence calls, over the whole prefill / decode time"]
    return "\n".join([head, *report.align(rows), *notes])
