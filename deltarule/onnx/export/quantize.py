"""The export's dtypes, under transformers.js's names, and their weight-only quantization
through ONNX Runtime's own quantizer (``onnxruntime.quantization.matmul_nbits_quantizer``).

A dtype (`DTYPES`) is a traced float dtype, optionally quantized, and the file name
transformers.js resolves for it (``model<suffix>.onnx``; ``embed_tokens<suffix>.onnx`` /
``decoder_model_merged<suffix>.onnx`` for a text-only pair):

=========  ======================  =================  =========================================
dtype      traced in               file suffix        weights
=========  ======================  =================  =========================================
``fp32``   float32                 (none)             float32
``fp16``   float16                 ``_fp16``          float16
``q8``     float32                 ``_quantized``     8-bit blocks (MatMulNBits)
``q4``     float32                 ``_q4``            4-bit blocks (MatMulNBits, GatherBlockQuantized)
``q4f16``  float16                 ``_q4f16``         4-bit blocks, float16 scales and activations
=========  ======================  =================  =========================================

``float32`` / ``float16`` are accepted for ``fp32`` / ``fp16``. Every weight MatMul (the LM
head included: a tied head gets a transposed copy of the embedding the quantizer can read, as
onnxruntime-genai's builder unties it) becomes ``com.microsoft.MatMulNBits``; with 4 bits the
embedding table becomes ``com.microsoft.GatherBlockQuantized`` (`Quantization.embeddings`; the
quantizer has no 8-bit Gather). The ``"onnx"`` target keeps to standard ops: its weights become
blocked ``DequantizeLinear`` -> ``MatMul`` (the quantizer's QDQ form; ONNX Runtime fuses the
pair into MatMulNBits when it loads the model). Weights with fewer than 1/16 as many columns as rows (Gated
DeltaNet's per-head a / b gate projections) stay float, as onnxruntime-genai's builder keeps them;
weights the quantizer cannot take (the 3-D expert tensors of a MoE layer, batched matmuls) stay
float too; `Quantized` names both.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx

from ...errors import ContractError, Unsupported
from .lean import narrow, weight_matmuls


@dataclass(frozen=True)
class Dtype:
    """One of `DTYPES`: transformers.js's `name`, the `traced` float dtype, the quantizer's
    `bits` (None: not quantized) and the file-name `suffix`."""

    name: str
    traced: str
    bits: int | None
    suffix: str


DTYPES = {d.name: d for d in (Dtype("fp32", "float32", None, ""), Dtype("fp16", "float16", None, "_fp16"),
                              Dtype("q8", "float32", 8, "_quantized"), Dtype("q4", "float32", 4, "_q4"),
                              Dtype("q4f16", "float16", 4, "_q4f16"))}
ALIASES = {"float32": "fp32", "float16": "fp16"}
# MatMulNBits / GatherBlockQuantized: a power of two >= 16; accuracy_level 0 (unset) to 4 (int8 compute)
BLOCK_SIZES = (16, 32, 64, 128, 256)
ACCURACY_LEVELS = (0, 1, 2, 3, 4)


@dataclass(frozen=True)
class Quantization:
    """How `q8` / `q4` / `q4f16` quantize, onnxruntime-genai's builder's defaults by default
    (``-p int4`` on CPU: blocks of 32, symmetric, accuracy level 4).

    Attributes:
        block_size: weights per scale, one of `BLOCK_SIZES` (default 32).
        symmetric: True (default): no zero points; False: a zero point per block.
        accuracy_level: MatMulNBits' ``accuracy_level``, one of `ACCURACY_LEVELS` (default 4:
            the activations quantized to int8 in the product, ONNX Runtime's fastest CPU path).
        embeddings: True (default): with 4 bits the embedding table is quantized too
            (GatherBlockQuantized); False keeps it float.
    """

    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 4
    embeddings: bool = True

    def check(self) -> "Quantization":
        """self, or `ContractError` naming the field."""
        for name, value, allowed in (("block_size", self.block_size, BLOCK_SIZES),
                                     ("accuracy_level", self.accuracy_level, ACCURACY_LEVELS)):
            if type(value) is not int or value not in allowed:
                raise ContractError(f"quantization.{name}", " | ".join(map(str, allowed)), repr(value))
        for name in ("symmetric", "embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ContractError(f"quantization.{name}", "a bool", repr(getattr(self, name)))
        return self


@dataclass(frozen=True)
class Quantized:
    """What quantizing one model did: the count of (domain, op) nodes it made, the weight
    MatMuls (node name, weight shape) kept float by choice (`deltarule.onnx.export.lean.narrow`: the
    per-head gate projections) and the weights the quantizer did not take (left float: 2-D
    weight MatMuls by node name, batched weights of rank >= 3, MoE experts, by tensor name)."""

    made: dict
    left_float: tuple
    kept_float: tuple = ()


def dtypes(dtype) -> list[Dtype]:
    """`dtype` (a name or a sequence of names) as `Dtype` records in the given order, aliases
    resolved and repeats dropped; `ContractError` naming ``dtype`` otherwise."""
    names = [dtype] if isinstance(dtype, str) else dtype
    allowed = " | ".join(repr(n) for n in (*DTYPES, *ALIASES))
    if isinstance(names, (bytes, dict)) or not hasattr(names, "__iter__"):
        raise ContractError("dtype", f"a dtype name or a list of them ({allowed})", repr(dtype))
    names = list(names)
    if not names:
        raise ContractError("dtype", f"at least one dtype ({allowed})", "none")
    found = []
    for name in names:
        if not isinstance(name, str) or ALIASES.get(name, name) not in DTYPES:
            raise ContractError("dtype", allowed, repr(name))
        record = DTYPES[ALIASES.get(name, name)]
        if record not in found:
            found.append(record)
    return found


def file_name(base: str, dtype: Dtype) -> str:
    """The file transformers.js loads for `base` (``model``, ``embed_tokens``,
    ``decoder_model_merged``) at `dtype`: ``model_q4.onnx``."""
    return f"{base}{dtype.suffix}.onnx"


def quantizes_embeddings(dtype: Dtype, quantization: Quantization, *, standard: bool) -> bool:
    """Whether `quantize` makes the embedding table GatherBlockQuantized: 4 bits, asked for, and a
    com.microsoft target (the quantizer has no 8-bit Gather; the standard form has no such op)."""
    return dtype.bits == 4 and quantization.embeddings and not standard


def quantize(model: onnx.ModelProto, dtype: Dtype, quantization: Quantization, *, standard: bool) -> tuple:
    """`model` with its weights quantized to `dtype.bits` by onnxruntime's weight-only quantizer
    (`standard`: the QDQ form of standard ops, for the ``"onnx"`` target); returns (model,
    `Quantized`). Raises `Unsupported` when the quantizer fails or quantizes no weight."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 MatMulNBitsQuantizer)
    from onnxruntime.quantization.quant_utils import QuantFormat
    model = _untie_transposed_weights(model)
    kept = [(node.name, list(w.dims)) for node, w in weight_matmuls(model) if narrow(w)]
    ops = ("MatMul", "Gather") if quantizes_embeddings(dtype, quantization, standard=standard) else ("MatMul",)
    config = DefaultWeightOnlyQuantConfig(
        block_size=quantization.block_size, is_symmetric=quantization.symmetric,
        accuracy_level=quantization.accuracy_level, bits=dtype.bits, op_types_to_quantize=ops,
        quant_axes=(("MatMul", 0), ("Gather", 1)), quant_format=QuantFormat.QDQ if standard else QuantFormat.QOperator)
    before = Counter((n.domain, n.op_type) for n in model.graph.node)
    try:
        with _quiet_quantizer():
            quantizer = MatMulNBitsQuantizer(model, bits=dtype.bits, block_size=quantization.block_size,
                                             is_symmetric=quantization.symmetric,
                                             accuracy_level=quantization.accuracy_level, algo_config=config,
                                             nodes_to_exclude=[name for name, _ in kept])
            quantizer.process()
    except Exception as error:           # noqa: BLE001 - whatever onnxruntime's quantizer raises
        raise Unsupported(f"onnxruntime's quantizer failed on the {dtype.name} model: "
                          f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from error
    result = quantizer.model.model
    after = Counter((n.domain, n.op_type) for n in result.graph.node)
    made = {op: after[op] - before.get(op, 0) for op in after if after[op] > before.get(op, 0)}
    left = tuple((node.name, list(w.dims)) for node, w in weight_matmuls(result) if not narrow(w))
    convs = {name for n in result.graph.node if n.op_type in ("CausalConvWithState", "Conv") for name in n.input}
    left += tuple((t.name, list(t.dims)) for t in result.graph.initializer   # batched (MoE expert) weights
                  if len(t.dims) >= 3 and t.name not in convs
                  and t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16))
    if not made:
        raise Unsupported(f"onnxruntime's quantizer quantized no weight of the {dtype.name} model "
                          f"({len(left)} weight MatMuls left float)")
    return result, Quantized(made, left, tuple(kept))


def _untie_transposed_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` (the quantizer rewrites the model it is given) in which a MatMul whose weight reaches it through ``Transpose`` of an
    initializer (a tied LM head: torch.onnx keeps one embedding table and transposes it for the
    head) reads a transposed copy instead: onnxruntime's quantizer takes only initializer weights
    (it skipped the head: 60 ms of a 198 ms Qwen3.5-0.8B decode step stayed float)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)            # (in memory: a 0.8B float32 model is past protobuf's 2 GB serialization)
    model = copy
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    consumers = Counter(name for node in graph.node for name in node.input)
    dead = []
    for node in graph.node:
        if node.op_type != "MatMul" or node.domain != "":
            continue
        transpose = producers.get(node.input[1])
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in initializers:
            continue
        weight = initializers[transpose.input[0]]
        perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), None)
        if len(weight.dims) != 2 or perm not in (None, [1, 0]):
            continue
        array = onnx.numpy_helper.to_array(weight)
        copy = onnx.numpy_helper.from_array(np.ascontiguousarray(array.T), name=f"{weight.name}.transposed")
        graph.initializer.append(copy)
        node.input[1] = copy.name
        consumers[transpose.output[0]] -= 1
        if consumers[transpose.output[0]] == 0:
            dead.append(transpose)
    for node in dead:
        graph.node.remove(node)
    return model


@contextlib.contextmanager
def _quiet_quantizer():
    """The quantizer logs a line per node at INFO (and an ERROR per Gather it skips at 8 bits),
    and NumPy warns of its all-zero blocks (their scale is 0: it writes zeros)."""
    import warnings
    loggers = [logging.getLogger(name) for name in ("onnxruntime.quantization.matmul_nbits_quantizer",
                                                    "onnxruntime.quantization")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
