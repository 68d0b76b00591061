"""Run an exported decoder (`deltarule.onnx.export.export_model`) token by token, as a runtime does: the
first step feeds zero states with a past of length 0, each later step the previous step's
present state.

    >>> session = DecoderSession("out/onnx/model.onnx")             # doctest: +SKIP
    >>> tokens = session.greedy(prompt_ids, max_new_tokens=16)      # [B, new] int64

``runner``: ``"ort"`` (default) an onnxruntime ``InferenceSession`` (CPU), ``"deltarule"``
`deltarule.onnx.Session` (linear-attention nodes computed by deltarule), ``"reference"`` onnx's
``ReferenceEvaluator`` (tiny models only: it is slow).

Bad arguments raise `deltarule.ContractError` naming the argument before any work: a model
file (``path``, ``embed``) that cannot be read, is truncated or is no decoder this class runs;
an unknown ``runner``; token ids (``ids``, ``prompt``) that are not a 2-D integer array of at
least one row and one token, or outside ``[0, vocab)``; a ``mask`` that is not ``[B, past + T]``
of 0 / 1; a ``past`` whose names, element types, ranks or sizes differ from the graph's inputs
(`deltarule.onnx.feeds.Inputs`: static dimensions, and the ``batch_size`` and
``past_sequence_length`` dimensions, which must be those of ``ids`` and ``mask``); fewer than
one new token.

The vocabulary (`DecoderSession.vocab`, the bound of the token ids) is the number of rows of
the embedding table the ids index (the ``Gather`` initializers that read ``input_ids``, in the
``embed`` model when there is one; the smallest if several), else the static last dimension
of the ``logits`` output. Where neither is known (a symbolic vocabulary) `vocab` is None and
only negative ids are refused up front; ids past the table are then refused by the runtime's
``Gather`` (ONNX Runtime: "indices element out of data bounds") when the step runs.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping

import numpy as np
import onnx

from ...errors import ContractError

RUNNERS = ("ort", "deltarule", "reference")
# the state dimensions a step checks against ids and mask (the names of deltarule's exports,
# onnxruntime-genai's builder's and transformers.js's); other symbolic ones are free, as in ORT
BATCH, PAST = "batch_size", "past_sequence_length"


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _vocab(model: onnx.ModelProto) -> int | None:
    """The rows of the embedding tables `input_ids` indexes (Gather initializers; the
    smallest), or the static last dimension of the `logits` output, or None."""
    graph = model.graph
    tables = {t.name: t for t in graph.initializer}
    rows = []
    for node in graph.node:
        if (node.op_type == "Gather" and node.domain in ("", "ai.onnx") and len(node.input) >= 2
                and node.input[1] == "input_ids" and node.input[0] in tables):
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            dims = tables[node.input[0]].dims
            if axis in (0, -len(dims)) and len(dims) >= 1:
                rows.append(int(dims[0]))
    if rows:
        return min(rows)
    for out in graph.output:
        if out.name == "logits":
            dims = out.type.tensor_type.shape.dim
            if len(dims) and dims[-1].HasField("dim_value"):
                return int(dims[-1].dim_value)
    return None


def _load(path, argument: str) -> onnx.ModelProto:
    from ..feeds import load
    if not isinstance(path, (str, os.PathLike)):
        raise ContractError(argument, "a path to an ONNX model file", type(path).__name__)
    return load(path, argument, load_external_data=False)


class DecoderSession:
    """An exported decoder and the state it carries between calls.

    Attributes:
        vocab: the bound of the token ids (None: symbolic; module docstring).
        inputs: the decoder's inputs, (name, dims, NumPy type) each (a dim: an int, or its name).
        outputs: its outputs' names (``logits`` first).
        feedback: present output -> the past input it feeds at the next step.
    """

    def __init__(self, path: str, *, runner: str = "ort", threads: int | None = None, sizes: dict | None = None,
                 embed: str | None = None):
        """`sizes`: values of symbolic state dimensions other than the batch and the past length
        (onnxruntime-genai's builder names the head size ``kv_cache_dim``); the others are 0.
        `embed`: an ``embed_tokens`` model (input_ids -> inputs_embeds) run before a decoder
        that takes ``inputs_embeds`` (transformers.js's text-only pair)."""
        from ..feeds import Inputs

        if not isinstance(runner, str) or runner not in RUNNERS:
            raise ContractError("runner", " | ".join(map(repr, RUNNERS)), repr(runner))
        if threads is not None and not _is_int(threads):
            raise ContractError("threads", "None or an int (onnxruntime's intra-op threads; 0: its default)",
                                repr(threads))
        if sizes is not None and not isinstance(sizes, Mapping):
            raise ContractError("sizes", "a mapping from a symbolic dimension's name to its size", type(sizes).__name__)
        self.sizes = dict(sizes or {})
        for name, size in self.sizes.items():
            if not isinstance(name, str) or not _is_int(size) or size < 0:
                raise ContractError(f"sizes[{name!r}]", "a size (an int >= 0) of a symbolic dimension named by a str",
                                    repr(size))
        model = _load(path, "path")
        embed_model = None if embed is None else _load(embed, "embed")

        graph = model.graph
        inputs = Inputs.of_graph(graph)
        self.inputs = []
        for value in graph.input:
            spec = inputs.declared[value.name]
            if spec.dtype is None:
                raise ContractError("path", "a decoder whose inputs are tensors of a NumPy element type",
                                    f"input {value.name!r} of {spec.type_text}")
            self.inputs.append((value.name, [d.dim_value if d.HasField("dim_value") else d.dim_param
                                             for d in value.type.tensor_type.shape.dim], spec.dtype.type))
        self.outputs = [o.name for o in graph.output]
        names = set(inputs.names)
        if not self.outputs or self.outputs[0] != "logits":
            raise ContractError("path", "a decoder whose first output is 'logits'", f"outputs {self.outputs}")
        if "attention_mask" not in names:
            raise ContractError("path", "a decoder with an 'attention_mask' input", f"inputs {inputs.names}")
        if "inputs_embeds" in names and "input_ids" not in names:
            if embed is None:
                raise ContractError("embed", "an embed_tokens model (input_ids -> inputs_embeds): the decoder "
                                    "takes inputs_embeds", None)
        elif "input_ids" not in names:
            raise ContractError("path", "a decoder with an 'input_ids' or 'inputs_embeds' input",
                                f"inputs {inputs.names}")
        elif embed is not None:
            raise ContractError("embed", "None: the decoder takes input_ids", repr(embed))
        if embed_model is not None:
            embed_inputs = {v.name: v for v in embed_model.graph.input}
            if "input_ids" not in embed_inputs or not len(embed_model.graph.output):
                raise ContractError("embed", "an embed_tokens model (input_ids -> inputs_embeds)",
                                    f"inputs {list(embed_inputs)}")
            self._embed_ids = Inputs([embed_inputs["input_ids"]]).declared["input_ids"]
            if self._embed_ids.dtype is None or self._embed_ids.dtype.kind not in "iu":
                raise ContractError("embed", "an embed_tokens model taking integer input_ids",
                                    f"input_ids of {self._embed_ids.type_text}")
        elif inputs.declared["input_ids"].dtype.kind not in "iu":
            raise ContractError("path", "a decoder taking integer input_ids",
                                f"input_ids of {inputs.declared['input_ids'].type_text}")
        self.vocab = _vocab(embed_model if embed_model is not None else model)
        if self.vocab is None and embed_model is not None:
            self.vocab = _vocab(model)

        # present -> past: deltarule's names (present_conv.i -> past_conv.i, present.i.key ->
        # past_key_values.i.key) and onnxruntime-genai's builder's (present.i.conv -> past.i.conv)
        self.feedback = {}
        for out in self.outputs[1:]:
            rest = out[len("present"):]
            found = [c for c in ("past" + rest, "past_key_values" + rest) if c in names]
            if not found:
                raise ContractError("path", "a decoder whose every output after logits is a present state "
                                    "with a past input", f"output {out!r} has no past input")
            self.feedback[out] = found[0]
        # the past inputs, checked at each step; their batch and past-length axes, which must be
        # the ids' batch and the mask's past (unless `sizes` gives them)
        past = [v for v in graph.input if v.name.startswith("past")]
        self._past = Inputs(past, set(inputs.names) - set(inputs.required))
        self._past_axes = {}
        for name, shape, _ in self.inputs:
            if name.startswith("past"):
                axes = [(axis, d) for axis, d in enumerate(shape)
                        if d == BATCH or (d == PAST and d not in self.sizes)]
                if axes:
                    self._past_axes[name] = axes
        self._types = {name: dtype for name, _, dtype in self.inputs}
        positions = [shape for name, shape, _ in self.inputs if name == "position_ids"]
        self.positions = bool(positions)                  # deltarule's Qwen3.5 exports take none
        self.mrope = self.positions and bool(positions[0]) and positions[0][0] == 3
        self.keeps_logits = "num_logits_to_keep" in names        # (deltarule.onnx.export.lean)
        self.embed = None if embed is None else DecoderSession._open(embed, "embed", runner, threads)
        self.session = DecoderSession._open(path, "path", runner, threads)

    @staticmethod
    def _open(path: str, argument: str, runner: str, threads: int | None):
        if runner == "ort":
            import onnxruntime as ort
            options = ort.SessionOptions()
            if threads:
                options.intra_op_num_threads = threads
            try:
                return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            except Exception as exc:
                raise ContractError(argument, "an ONNX model onnxruntime loads",
                                    f"{os.fspath(path)!r} ({type(exc).__name__}: {str(exc).strip()})") from exc
        if runner == "deltarule":
            from .. import Session
            return Session(path)
        from onnx.reference import ReferenceEvaluator
        return ReferenceEvaluator(path)

    def _token_id_ok(self, token: int) -> bool:
        return 0 <= token and (self.vocab is None or token < self.vocab)

    def _ids(self, ids, argument: str) -> np.ndarray:
        """`ids` checked: a 2-D integer array [B >= 1, T >= 1] of ids in [0, vocab)."""
        if not isinstance(ids, np.ndarray):
            raise ContractError(argument, "token ids, a 2-D integer numpy array [batch, length]", type(ids).__name__)
        if ids.dtype.kind not in "iu":
            raise ContractError(argument, "token ids of an integer element type", str(ids.dtype))
        if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise ContractError(argument, "token ids [batch >= 1, length >= 1] (2-D)", f"shape {list(ids.shape)}")
        low, high = ids.min(), ids.max()
        if low < 0 or (self.vocab is not None and high >= self.vocab):
            bad = low if low < 0 else high
            where = tuple(int(i) for i in np.argwhere(ids == bad)[0])
            bound = "vocab" if self.vocab is None else self.vocab
            raise ContractError(argument, f"token ids in [0, {bound})", f"{argument}{list(where)} = {int(bad)}")
        return ids

    def zero_state(self, batch: int) -> dict:
        """The first step's past: zeros, past length 0 (every symbolic size but the batch and `sizes`)."""
        if not _is_int(batch) or batch < 1:
            raise ContractError("batch", "a batch size, an int >= 1", repr(batch))
        state = {}
        for name, shape, dtype in self.inputs:
            if name.startswith("past"):
                state[name] = np.zeros([batch if d == BATCH else (d if isinstance(d, int) else
                                                                   self.sizes.get(d, 0)) for d in shape],
                                       dtype=dtype)
        return state

    def step(self, ids: np.ndarray, mask: np.ndarray, past: dict, *, keep_logits: int = 0) -> tuple[np.ndarray, dict]:
        """One call: ids [B, T], mask [B, past + T] -> (logits [B, T, vocab], the present state
        under the past's names). `keep_logits` n > 0: only the last n positions' logits
        ([B, min(n, T), vocab]; computed only for those where the decoder takes
        ``num_logits_to_keep``, sliced after the run otherwise)."""
        if not _is_int(keep_logits) or keep_logits < 0:
            raise ContractError("keep_logits", "an int >= 0 (0: every position)", repr(keep_logits))
        ids = self._ids(ids, "ids")
        B, T = ids.shape
        if not isinstance(mask, np.ndarray):
            raise ContractError("mask", "an attention mask, a 2-D numpy array [batch, past + length]",
                                type(mask).__name__)
        if mask.dtype.kind not in "biuf":
            raise ContractError("mask", "an attention mask of 0 / 1 (bool, integer or float)", str(mask.dtype))
        if mask.ndim != 2 or mask.shape[0] != B or mask.shape[1] < T:
            raise ContractError("mask", f"shape [batch, past + length] with batch {B} and length {T} (those of ids)",
                                f"shape {list(mask.shape)}")
        if mask.dtype.kind != "b" and ((mask != 0) & (mask != 1)).any():
            raise ContractError("mask", "an attention mask of 0 / 1", f"values {np.unique(mask)[:8].tolist()}")
        P = mask.shape[1] - T
        label = "past[{!r}]".format
        past = self._past.check(past, argument="past", label=label)
        for name, axes in self._past_axes.items():
            shape = past[name].shape
            for axis, dim in axes:
                want, what = (B, "the batch of ids") if dim == BATCH else \
                    (P, f"the past length, mask length {mask.shape[1]} - ids length {T}")
                if shape[axis] != want:
                    raise ContractError(label(name), f"dimension {axis} ({dim}) {want}: {what}",
                                        f"shape {list(shape)}")
        return self._run(ids, mask, past, keep_logits)

    def _run(self, ids: np.ndarray, mask: np.ndarray, past: dict, keep_logits: int = 0) -> tuple[np.ndarray, dict]:
        """`step` on checked arguments."""
        B, T = ids.shape
        P = mask.shape[1] - T
        types = self._types
        if self.embed is not None:
            first = {"inputs_embeds": self.embed.run(None, {"input_ids": ids.astype(self._embed_ids.dtype)})[0]}
        else:
            first = {"input_ids": ids.astype(types["input_ids"])}
        feeds = {**first, "attention_mask": mask.astype(types["attention_mask"]), **past}
        if self.positions:
            pos = np.broadcast_to(np.arange(P, P + T, dtype=np.int64), (B, T))
            if self.mrope:
                pos = np.broadcast_to(pos, (3, B, T))
            feeds["position_ids"] = np.ascontiguousarray(pos, dtype=types["position_ids"])
        if self.keeps_logits:
            feeds["num_logits_to_keep"] = np.array(keep_logits, dtype=np.int64)
        out = dict(zip(self.outputs, self.session.run(None, feeds)))
        if keep_logits and not self.keeps_logits:
            out["logits"] = out["logits"][:, -keep_logits:]
        return out["logits"], {self.feedback[name]: value for name, value in out.items() if name != "logits"}

    def greedy(self, prompt: np.ndarray, max_new_tokens: int, *, eos_token_id: int | None = None,
               pad_token_id: int = 0) -> np.ndarray:
        """Greedy tokens after `prompt` [B, T] (no padding): [B, max_new_tokens]. A row that
        produced `eos_token_id` continues with `pad_token_id` (as transformers' ``generate``;
        the model is fed `pad_token_id` for it, or token 0 where that is no token id)."""
        prompt = self._ids(prompt, "prompt")
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ContractError("max_new_tokens", "an int >= 1", repr(max_new_tokens))
        if eos_token_id is not None and not _is_int(eos_token_id):
            raise ContractError("eos_token_id", "None or one token id (an int)", repr(eos_token_id))
        if not _is_int(pad_token_id):
            raise ContractError("pad_token_id", "a token id (an int)", repr(pad_token_id))
        fed_pad = pad_token_id if self._token_id_ok(pad_token_id) else 0
        B = prompt.shape[0]
        past, ids, tokens = self.zero_state(B), prompt, []
        mask = np.ones((B, prompt.shape[1]), dtype=np.int64)
        done = np.zeros(B, dtype=bool)
        for _ in range(max_new_tokens):
            logits, past = self._run(ids, mask, past, 1)
            best = logits[:, -1].argmax(-1)
            next_ids = np.where(done, pad_token_id, best).astype(np.int64)
            fed = next_ids if fed_pad == pad_token_id else np.where(done, fed_pad, best).astype(np.int64)
            if eos_token_id is not None:
                done |= next_ids == eos_token_id
            ids = fed[:, None]
            tokens.append(next_ids[:, None])
            mask = np.ones((B, mask.shape[1] + 1), dtype=np.int64)
        return np.concatenate(tokens, axis=1)
