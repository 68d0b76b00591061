"""`deltarule.onnx.export.export_model`: a transformers hybrid checkpoint to an ONNX decoder with fused
linear-attention nodes (docs/export.md).

Route: transformers' model on deltarule (`integrations.transformers.enable`), wrapped as a
function of plain tensors (`decoder.Decoder`), traced by `torch.export` (every
linear-attention call is one ``deltarule::linear_attention`` op, every short convolution one
``deltarule::causal_conv1d_with_state``), converted by `torch.onnx` with deltarule's
translations (`translate`), and made final for the target (`graph`). Every modeling detail
(norms, rotary forms, gated attention, MoE routing, masks) comes from transformers itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field

import torch

from ...errors import ContractError, Unsupported, one_line
from . import genai, graph, lean, quantize, translate
from .folder import COPIED, check_out_dir, staged
from .decoder import Decoder, StateLayout, state_layout, text_config
from .quantize import Quantization

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}
# a checkpoint's weights, one of these beside its config.json (transformers' file names)
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# torch.export's trace sizes (seq and past >= 2: 0 and 1 would be specialized; the graph is
# valid for every size, T = 1 and past 0 included: tests run them)
_TRACE = dict(batch=2, seq=3, past=2)
_NAMESPACES = ("aten", "prims", "deltarule")
MIN_TRANSFORMERS = (5, 25)
EXTERNAL_DATA_BYTES = (1 << 31) - (1 << 27)
# torch.onnx's opset for the standard ops, by dtype (the onnx target's is raised to 27 after):
# at 23 attention is one Attention node (decode after 1024 tokens 0.98x onnxruntime-genai's model
# where 18's MatMul / Softmax gave 0.90x: docs/performance.md); in float16 torch 2.13's exporter
# emits at 23 an RMSNormalization of a float16 input with a float32 scale, which onnxruntime refuses
OPSETS = {torch.float32: 23, torch.float16: 18}


@dataclass
class Exported:
    """What `onnx` wrote.

    Attributes:
        directory: `out_dir`.
        path: the first dtype's decoder (``onnx/model<suffix>.onnx``).
        target: the target (`graph.TARGETS`).
        inputs, outputs: the decoder's input and output names, in order.
        layout: the first dtype's state layout (`decoder.StateLayout`).
        ops: the count of (domain, op) nodes of the first dtype's decoder.
        no_genai_config: why genai_config.json was not written (None: it was).
        text_only: the first dtype's text-only pair transformers.js loads for a
            ``...ForConditionalGeneration`` checkpoint (``embed_tokens``,
            ``decoder_model_merged``: paths; empty otherwise).
        dtypes: the dtypes written, transformers.js's names, in the order asked.
        models: dtype -> {"model": path, and for a text-only pair "embed_tokens",
            "decoder_model_merged": paths}.
        quantized: dtype -> `quantize.Quantized` (the quantized dtypes: what the quantizer
            made, which weights it left float).
        genai_model: the decoder genai_config.json names (relative to `directory`), or None.
    """

    directory: str
    path: str
    target: str
    inputs: list[str]
    outputs: list[str]
    layout: StateLayout
    ops: dict = field(repr=False)
    no_genai_config: str | None = None
    text_only: dict = field(default_factory=dict)
    dtypes: list = field(default_factory=list)
    models: dict = field(default_factory=dict)
    quantized: dict = field(default_factory=dict, repr=False)
    genai_model: str | None = None


def export_model(model_dir: str, out_dir: str, *, target: str = "ort", dtype="fp32",
         quantization: Quantization | None = None, num_logits_to_keep: bool = False,
         overwrite: bool = False) -> Exported:
    """Export the transformers causal LM checkpoint in `model_dir` to `out_dir` as ONNX.

    Args:
        model_dir: a local checkpoint folder (``config.json`` and weights) of a hybrid family
            transformers ships (Qwen3-Next, Qwen3.5 dense / MoE, Kimi Linear, OLMo-Hybrid).
        out_dir: a new or empty folder (made if absent; not the checkpoint, inside it or around
            it); receives, per dtype, ``onnx/model<suffix>.onnx`` (and ``<file>_data`` when the
            weights pass 2 GB); for a ``...ForConditionalGeneration`` checkpoint (a published
            Qwen3.5) also ``onnx/embed_tokens<suffix>.onnx`` (input_ids -> inputs_embeds) and
            ``onnx/decoder_model_merged<suffix>.onnx`` (inputs_embeds in: what transformers.js
            loads for its text model); the checkpoint's config, generation config and
            tokenizer files, and ``genai_config.json`` (for the families onnxruntime-genai
            runs: `deltarule.onnx.export.genai`).
        target: ``"ort"`` (default): ONNX Runtime's ``com.microsoft.LinearAttention`` and
            ``CausalConvWithState`` (its CPU form); ``"ort-gpu"``: ``com.microsoft.GatedDeltaNet``
            (its CUDA / WebGPU form; gates, beta's sigmoid and the L2 norm fused into the node,
            the recurrent state V-major [batch, Hv, V, K]; WebGPU lacks the per-key decay of Kimi
            Linear) and ``CausalConvWithState``; ``"onnx"``: the standard ops of opset 27.
        dtype: one of transformers.js's dtype names or a list of them, each written to the
            file transformers.js loads for it (`deltarule.onnx.export.quantize`): ``"fp32"``
            (default; ``"float32"``), ``"fp16"`` (``"float16"``), ``"q8"``, ``"q4"``,
            ``"q4f16"``. Floats are the weights' and activations' dtype (the recurrent state
            stays float32); q8 / q4 are the float32 model, q4f16 the float16 one, with weights
            quantized by onnxruntime's weight-only quantizer. One trace per float dtype serves
            every dtype built on it.
        quantization: how q8 / q4 / q4f16 quantize (`quantize.Quantization`; default:
            onnxruntime-genai's ``-p int4`` defaults: blocks of 32, symmetric, accuracy level 4).
            Refused without a quantized dtype.
        num_logits_to_keep: False (default): logits for every position; True: the decoders take
            ``num_logits_to_keep`` (an int64 scalar, as transformers.js feeds it: 0 for every
            position, n for the last n) and compute only those rows (`deltarule.onnx.export.lean`).
            onnxruntime-genai does not feed it: no genai_config.json is written then.
        overwrite: False (default): an `out_dir` holding anything is refused; True: what an
            export writes there (``onnx/``, ``genai_config.json``, the copied checkpoint files)
            is removed first, other files are kept.

    Everything is written into a temporary folder beside `out_dir` and moved into place at the
    end (``onnx/`` last): an export that fails or is killed leaves no model in `out_dir`.

    Returns:
        `Exported`. The decoder's inputs and outputs are named as transformers.js names them
        (docs/export.md): ``input_ids``, ``attention_mask``, ``position_ids`` and the past
        state in, ``logits`` and the present state out.

    Raises:
        deltarule.ContractError: a bad argument or path (checked before the checkpoint loads),
            or a checkpoint whose weights do not fit its model (missing, unexpected or
            mismatched tensors, named), before anything is written.
        deltarule.Unsupported: a family or call the target cannot express, naming the layer
            and what is missing, or a quantizer failure, before anything is written.

    Example::

        >>> import tempfile
        >>> from deltarule.tools.bench import checkpoints
        >>> checkpoint = checkpoints.save("qwen3_5", tempfile.mkdtemp())     # tiny, random weights
        >>> result = export_model(checkpoint, tempfile.mkdtemp(), dtype=["fp32", "q4"])
        >>> result.ops[("com.microsoft", "LinearAttention")], result.inputs[:4]
        (1, ['input_ids', 'attention_mask', 'past_conv.0', 'past_recurrent.0'])
        >>> [os.path.basename(m["model"]) for m in result.models.values()]
        ['model.onnx', 'model_q4.onnx']
    """
    model_dir, out_dir, wanted, quantization = check_arguments(
        model_dir, out_dir, target=target, dtype=dtype, quantization=quantization,
        num_logits_to_keep=num_logits_to_keep, overwrite=overwrite)
    config = model_config(model_dir)
    traced = {d.traced for d in wanted}
    models, quantized, first = {d.name: None for d in wanted}, {}, None
    with staged(out_dir, overwrite=overwrite) as staging:
        external = {}
        for float_name in [name for name in _TORCH_DTYPES if name in traced]:
            model = load(model_dir, _TORCH_DTYPES[float_name], config=config)
            parts, layout, inputs, outputs, ops = _export_parts(model, model_dir, target, num_logits_to_keep)
            # the quantized dtypes first: they work on copies, and saving a float model whose
            # weights pass 2 GB moves them out of the proto (external data)
            for d in sorted((d for d in wanted if d.traced == float_name), key=lambda d: d.bits is None):
                written = {}
                for base, proto in parts.items():
                    if d.bits is not None:
                        proto, quantized.setdefault(d.name, {})[base] = _quantized(proto, base, d, quantization, target)
                    path = os.path.join(staging, "onnx", quantize.file_name(base, d))
                    if _save(proto, path):
                        external[os.path.basename(path)] = 1
                    written[base] = os.path.join(out_dir, "onnx", os.path.basename(path))
                models[d.name] = written
                if d is wanted[0]:
                    first = (layout, inputs, outputs, ops, model.config)
            del model, parts
        _copy_checkpoint_files(model_dir, staging, external)
        layout, inputs, outputs, ops, hf_config = first
        genai_dtype = next((d for d in wanted if d.name == "q4"), wanted[0])
        genai_model = f"onnx/{quantize.file_name('model', genai_dtype)}"
        no_genai = ("the decoder takes num_logits_to_keep, which onnxruntime-genai does not feed"
                    if num_logits_to_keep else _write_genai_config(hf_config, layout, staging, filename=genai_model))
    quantized = {name: parts_of["model"] for name, parts_of in quantized.items()}
    head = models[wanted[0].name]
    text_only = {name: path for name, path in head.items() if name != "model"}
    return Exported(out_dir, head["model"], target, inputs, outputs, layout, dict(ops), no_genai, text_only,
                    [d.name for d in wanted], models, quantized, None if no_genai else genai_model)


def _export_parts(model, model_dir: str, target: str, num_logits_to_keep: bool) -> tuple:
    """`model` traced, converted and made lean (`lean`): ({"model": decoder, and for a text-only
    checkpoint "decoder_model_merged", "embed_tokens"}, layout, inputs, outputs, the decoder's
    op counts)."""
    with _on_deltarule():
        layout = state_layout(model)
        program = _trace(model, layout)
        inputs = ["input_ids", "attention_mask", *(["position_ids"] if layout.takes_positions else []),
                  *(t.name for t in layout.tensors)]
        outputs = ["logits"] + [t.present for t in layout.tensors]
        roles = {("input_ids", 0): "batch_size", ("input_ids", 1): "sequence_length",
                 ("attention_mask", 1): "total_sequence_length"}
        roles.update({(t.name, 2): "past_sequence_length" for t in layout.tensors if t.kind in ("key", "value")})
        opset = OPSETS[layout.dtype]
        parts = {"model": to_onnx(program, target, inputs=inputs, outputs=outputs, roles=roles, opset=opset)}
        if text_only_split(model_dir):
            parts["decoder_model_merged"] = to_onnx(
                _trace(model, layout, embeds=True), target, inputs=["inputs_embeds", *inputs[1:]], outputs=outputs,
                roles={**roles, ("inputs_embeds", 0): "batch_size", ("inputs_embeds", 1): "sequence_length"},
                opset=opset)
            batch, seq = torch.export.Dim("batch_size", min=1, max=4096), torch.export.Dim("sequence_length", max=1 << 20)
            embed = torch.export.export(_Embed(model), (torch.ones(2, 3, dtype=torch.long),),
                                        dynamic_shapes=({0: batch, 1: seq},), strict=False)
            parts["embed_tokens"] = to_onnx(embed, target, inputs=["input_ids"], outputs=["inputs_embeds"],
                                            roles={("input_ids", 0): "batch_size", ("input_ids", 1): "sequence_length"},
                                            opset=opset)
    for name in ("model", "decoder_model_merged"):
        if name in parts:
            lean.shared_kv_heads(parts[name])
            lean.merge_sibling_matmuls(parts[name])
            lean.l2_norms(parts[name])
            if target != "onnx":                  # (a com.microsoft op: not in the standard target)
                lean.skip_rms_norms(parts[name])
            if num_logits_to_keep:
                lean.keep_last_logits(parts[name])
    if num_logits_to_keep:
        inputs = [*inputs, lean.NUM_LOGITS_TO_KEEP]
    linear = len(layout.linear_layers)
    ops = graph.check(parts["model"], target, linear_layers=linear, convs=linear)
    if "decoder_model_merged" in parts:
        graph.check(parts["decoder_model_merged"], target, linear_layers=linear, convs=linear)
    if target in translate.GATED_DELTA_NET_TARGETS:     # the graph's recurrent state is V-major (fuse.v_major_state)
        layout = layout.v_major()
    return parts, layout, inputs, outputs, ops


def _quantized(proto, base: str, dtype, quantization: Quantization, target: str):
    """`proto` (the part `base`) at the quantized `dtype`: (model, `quantize.Quantized`). The
    text-only pair's ``embed_tokens`` is only a Gather: quantized where the embedding is."""
    standard = target == "onnx"
    if base == "embed_tokens" and not quantize.quantizes_embeddings(dtype, quantization, standard=standard):
        return proto, quantize.Quantized({}, ())
    return quantize.quantize(proto, dtype, quantization, standard=standard)


def check_arguments(model_dir, out_dir, *, target, dtype, quantization=None, num_logits_to_keep=False,
                    overwrite=False) -> tuple:
    """Every argument of `onnx` and both folders, before anything loads: (model_dir, out_dir
    as ``str``, the dtypes as `quantize.Dtype` records, the `Quantization`), or `ContractError`
    naming the argument."""
    if not isinstance(target, str) or target not in graph.TARGETS:
        raise ContractError("target", " | ".join(repr(x) for x in graph.TARGETS), repr(target))
    wanted = quantize.dtypes(dtype)
    if quantization is not None:
        if not isinstance(quantization, Quantization):
            raise ContractError("quantization", "a deltarule.onnx.export.Quantization or None", repr(quantization))
        if all(d.bits is None for d in wanted):
            raise ContractError("quantization", "None without a quantized dtype (q8, q4, q4f16)",
                                f"{quantization!r} with dtype {[d.name for d in wanted]}")
    quantization = (quantization or Quantization()).check()
    for name, value in (("num_logits_to_keep", num_logits_to_keep), ("overwrite", overwrite)):
        if not isinstance(value, bool):
            raise ContractError(name, "a bool", repr(value))
    if not isinstance(model_dir, (str, os.PathLike)) or not os.path.isdir(model_dir):
        raise ContractError("model_dir", "a checkpoint folder", repr(model_dir))
    model_dir = os.fspath(model_dir)
    config = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config):
        raise ContractError("model_dir", "a checkpoint folder with a config.json", model_dir)
    try:
        with open(config, encoding="utf-8") as f:
            parsed = json.load(f)
    except (OSError, ValueError) as error:        # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise ContractError("model_dir", "a config.json that parses as JSON", f"{config}: {error}") from None
    if not isinstance(parsed, dict):
        raise ContractError("model_dir", "a config.json holding a JSON object", f"{config}: {type(parsed).__name__}")
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in WEIGHTS):
        raise ContractError("model_dir", f"a checkpoint with its weights ({' or '.join(WEIGHTS)})",
                            f"{model_dir} holding {', '.join(sorted(os.listdir(model_dir)))}")
    return model_dir, check_out_dir(out_dir, model_dir, overwrite=overwrite), wanted, quantization


def to_onnx(program: torch.export.ExportedProgram, target: str, *, inputs: list[str], outputs: list[str],
            roles: dict, opset: int = 23) -> "onnx.ModelProto":
    """An exported program holding deltarule's ops as the ONNX model of `target`
    (`graph.TARGETS`), its inputs and outputs named `inputs` / `outputs`, the dimensions named by
    `roles` ((input name, axis) -> a `graph.DIMENSIONS` name), torch.onnx's standard ops at
    `opset`. Refuses (`Unsupported`, naming the layer) a call no node expresses before converting."""
    if not isinstance(target, str) or target not in graph.TARGETS:
        raise ContractError("target", " | ".join(repr(t) for t in graph.TARGETS), repr(target))
    _check_calls(program, target)
    onnx_program = torch.onnx.export(program, dynamo=True, custom_translation_table=translate.translation_table(target),
                                     input_names=inputs, output_names=outputs, optimize=True, verbose=False,
                                     opset_version=opset)
    proto = onnx_program.model_proto
    return graph.finish(proto, target, symbols=graph.symbols_of(proto, roles))


def load(model_dir: str, dtype: torch.dtype, *, config=None):
    """The checkpoint as transformers' causal LM, evaluation mode, MoE experts in a traceable
    form. Refuses a model transformers cannot run or deltarule cannot export (`Unsupported`)
    before reading the weights, and weights that do not fit the model (`ContractError` naming
    each missing, unexpected or mismatched tensor): transformers would fill them randomly.
    `config`: `model_config(model_dir)` where the caller has it."""
    import transformers
    config = model_config(model_dir) if config is None else config
    config._experts_implementation = "batched_mm"   # MoE: the default loop's shapes are data-dependent
    from safetensors import SafetensorError
    try:
        with _quiet():                                # its load report: refused below, by name
            model, report = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, config=config, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True)
    except ValueError as error:                       # a family without a causal-LM class (glm5_next)
        raise Unsupported(f"{model_dir}: transformers' AutoModelForCausalLM does not load model_type "
                          f"{config.model_type!r}: {one_line(error, 400)}") from error
    except (OSError, SafetensorError) as error:       # weights transformers cannot read (a truncated file)
        raise ContractError("model_dir", "a checkpoint whose weights transformers reads",
                            f"{model_dir}: {type(error).__name__}: {one_line(error, 400)}") from error
    problems = _weight_problems(report)
    if problems:
        raise ContractError("model_dir", "weights that fit the model (transformers would initialise the rest "
                            "randomly)", f"{model_dir}: " + "; ".join(problems))
    return model.eval()


def model_config(model_dir: str):
    """transformers' config of the checkpoint, checked: a transformers release that has the
    layers the export traces, a model type it knows, a hybrid with linear-attention layers and
    at least one other kind (transformers' cache needs an attention layer to run)."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < MIN_TRANSFORMERS:
        raise Unsupported(f"deltarule export needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} (its "
                          f"layers' causal_conv1d_forward and linear-attention cache), not {transformers.__version__}")
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    if model_type is not None and model_type not in transformers.CONFIG_MAPPING:
        raise Unsupported(f"{model_dir}: transformers {transformers.__version__} does not know model_type "
                          f"{model_type!r}")
    try:
        with _quiet():
            config = transformers.AutoConfig.from_pretrained(model_dir)
    except Exception as error:    # noqa: BLE001 - transformers' and huggingface_hub's config checks raise many types
        raise ContractError("model_dir", f"a config.json transformers {transformers.__version__} accepts",
                            f"{model_dir}: {type(error).__name__}: {one_line(error, 400)}") from error
    text = text_config(config)
    kinds = set(getattr(text, "layer_types", None) or ())
    if "linear_attention" not in kinds:
        raise Unsupported(f"{model_dir}: model_type {text.model_type!r} has no linear-attention layers "
                          f"(layer_types {sorted(kinds) or 'absent'}); deltarule exports the hybrid families")
    if kinds == {"linear_attention"}:
        raise Unsupported(f"{model_dir}: every layer of model_type {text.model_type!r} is a linear-attention "
                          f"layer; transformers runs the hybrids only with an attention layer (its cache's mask sizes)")
    return config


@contextlib.contextmanager
def _quiet():
    """transformers' progress bars and warnings (its load report: the export refuses what it
    reports, by name) and fla's import-time CPU warning off while a checkpoint loads."""
    import warnings

    from transformers.utils import logging as hf_logging
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"fla\.")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _weight_problems(report: dict) -> list[str]:
    """transformers' loading report as the problems it names (none: the weights fit)."""
    problems = []
    for kind, what in (("missing_keys", "missing"), ("unexpected_keys", "unexpected")):
        names = sorted(report.get(kind) or ())
        if names:
            problems.append(f"{what} {_listed(names)}")
    mismatched = sorted(report.get("mismatched_keys") or ())
    if mismatched:
        problems.append("mismatched " + _listed([f"{name} (checkpoint {list(saved)}, model {list(wanted)})"
                                                 for name, saved, wanted in mismatched]))
    problems += [one_line(e, 400) for e in report.get("error_msgs") or ()]
    return problems


def _listed(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


@contextlib.contextmanager
def _on_deltarule():
    """transformers' linear-attention layers on deltarule while exporting (as they were after)."""
    from ...integrations import transformers as integration
    was = integration.enabled()
    integration.enable(strict=False)
    try:
        yield
    finally:
        if not was:
            integration.disable()


def example_inputs(layout: StateLayout, *, batch: int, seq: int, past: int, vocab: int, dtype=torch.float32,
                   generator: torch.Generator | None = None):
    """Inputs of `Decoder` (ids, mask, positions [B, T], past state; random state of a modest size)."""
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    mask = torch.ones(batch, past + seq, dtype=torch.long)
    pos = torch.arange(past, past + seq).expand(batch, seq)
    state = []
    for t in layout.tensors:
        shape = [batch if i == 0 else (past if s is None else s) for i, s in enumerate(t.shape)]
        x = torch.randn(*shape, generator=generator) * (0.1 if t.kind == "recurrent" else 1.0)
        state.append(x.to(torch.float32 if t.kind == "recurrent" else dtype))
    return ids, mask, pos.contiguous(), state


def _trace(model, layout: StateLayout, *, embeds: bool = False) -> torch.export.ExportedProgram:
    """`Decoder(model, layout)` exported (input_ids in, or inputs_embeds with `embeds`)."""
    vocab = text_config(model.config).vocab_size
    ids, mask, pos, state = example_inputs(layout, **_TRACE, vocab=vocab, dtype=layout.dtype)
    if embeds:
        with torch.no_grad():
            ids = model.get_input_embeddings()(ids)
    batch = torch.export.Dim("batch_size", min=1, max=4096)
    seq = torch.export.Dim("sequence_length", min=2, max=1 << 20)
    past = torch.export.Dim("past_sequence_length", min=2, max=1 << 20)
    total = torch.export.Dim("total_sequence_length", min=4, max=1 << 21)
    # (ids, mask, *args): args are the positions (where taken) and the state
    shapes = ({0: batch, 1: seq, **({2: None} if embeds else {})}, {0: batch, 1: total},
              (*([{0: batch, 1: seq}] if layout.takes_positions else []),
               *({0: batch, 2: past} if t.kind in ("key", "value") else {0: batch} for t in layout.tensors)))
    try:
        with torch.no_grad():
            return torch.export.export(Decoder(model, layout, embeds=embeds),
                                       (ids, mask, *([pos] if layout.takes_positions else []), *state),
                                       dynamic_shapes=shapes, strict=False)
    except Exception as error:                         # noqa: BLE001 - whatever torch.export refuses
        raise Unsupported(f"{layout.model_type}: torch.export cannot trace transformers' model "
                          f"({type(error).__name__}: {str(error).splitlines()[0]})") from error


class _Embed(torch.nn.Module):
    """The model's input embedding: input_ids -> inputs_embeds (transformers.js's ``embed_tokens``)."""

    def __init__(self, model):
        super().__init__()
        self.embedding = model.get_input_embeddings()

    def forward(self, input_ids):
        return self.embedding(input_ids)


def _layer(node) -> str:
    """The module path of the layer an exported node comes from (``model.layers.0.linear_attn``)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values() if path]
    return paths[-1] if paths else "(the exported module itself)"


def _check_calls(program: torch.export.ExportedProgram, target: str = "ort") -> None:
    """Refuse, naming the layer, a call no node of `target` expresses: a deltarule call
    `translate.refusal` names, or an op of another library (no translation)."""
    from ...arguments import op_names
    names = op_names()
    for node in program.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        namespace = node.target.namespace
        if namespace not in _NAMESPACES:
            raise Unsupported(f"layer {_layer(node)}: op {node.target} has no ONNX translation")
        if node.target is torch.ops.deltarule.linear_attention.default:
            reason = translate.refusal(dict(zip(names, node.args)), target)
            if reason:
                raise Unsupported(f"layer {_layer(node)}: {reason}")
        elif namespace == "deltarule" and node.target is not torch.ops.deltarule.causal_conv1d_with_state.default:
            raise Unsupported(f"layer {_layer(node)}: a state slab (state_indices) has no LinearAttention node "
                              f"({node.target})")


def _copy_checkpoint_files(model_dir: str, out_dir: str, external: dict) -> None:
    """The checkpoint's config, generation config and tokenizer files beside the models; the
    config tells transformers.js which model files have their weights in ``<file>_data``
    (`external`: file name -> chunk count; it fetches them in a browser only when told). (`out_dir`
    is the staging folder: `folder.staged`.)"""
    for name in COPIED:
        source = os.path.join(model_dir, name)
        if os.path.isfile(source):
            shutil.copyfile(source, os.path.join(out_dir, name))
    if external:
        config_path = os.path.join(out_dir, "config.json")
        with open(config_path) as f:
            config = json.load(f)
        config.setdefault("transformers.js_config", {})["use_external_data_format"] = dict(sorted(external.items()))
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)


def _save(proto, path: str) -> bool:
    """`proto` at `path`; its weights in ``<file>_data`` beside it when they pass
    `EXTERNAL_DATA_BYTES` (what one protobuf file holds, 2 GB, less a margin). Returns whether
    they went there. torch.onnx's per-node debug records (stack traces, fx node names: half of
    a tiny model's file) are not written."""
    import onnx
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for node in proto.graph.node:
        del node.metadata_props[:]
    if sum(len(t.raw_data) for t in proto.graph.initializer) > EXTERNAL_DATA_BYTES:
        onnx.save_model(proto, path, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=os.path.basename(path) + "_data", size_threshold=1024)
        return True
    onnx.save_model(proto, path)
    return False


def text_only_split(model_dir: str) -> bool:
    """Whether transformers.js loads the checkpoint as ``embed_tokens`` + ``decoder_model_merged``
    (its ``resolveTypeConfig``: a ``...ForConditionalGeneration`` architecture loaded by a
    ``...ForCausalLM`` class, e.g. a published Qwen3.5). Read from the checkpoint's config.json:
    the loaded causal LM's config is the text model's, without that architecture."""
    with open(os.path.join(model_dir, "config.json")) as f:
        architectures = json.load(f).get("architectures") or [""]
    return architectures[0].endswith("ForConditionalGeneration")


def _write_genai_config(config, layout: StateLayout, out_dir: str, *, filename: str) -> str | None:
    """genai_config.json for onnxruntime-genai (`deltarule.onnx.export.genai`) naming the decoder
    `filename`; the reason it is not written (a family genai cannot run), or None."""
    try:
        config = genai.genai_config(config, layout, filename=filename, state_names=genai.STATE_NAMES)
    except Unsupported as reason:
        return str(reason)
    with open(os.path.join(out_dir, "genai_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return None
