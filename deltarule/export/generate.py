"""Run an exported decoder (`deltarule.export.onnx`) token by token, as a runtime does: the
first step feeds zero states with a past of length 0, each later step the previous step's
present state.

    >>> session = DecoderSession("out/onnx/model.onnx")             # doctest: +SKIP
    >>> tokens = session.greedy(prompt_ids, max_new_tokens=16)      # [B, new] int64

``runner``: ``"ort"`` (default) an onnxruntime ``InferenceSession`` (CPU), ``"deltarule"``
`deltarule.onnx.Session` (linear-attention nodes computed by deltarule), ``"reference"`` onnx's
``ReferenceEvaluator`` (tiny models only: it is slow).
"""

from __future__ import annotations

import numpy as np
import onnx

_NUMPY = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.INT64: np.int64,
          onnx.TensorProto.INT32: np.int32}


class DecoderSession:
    """An exported decoder and the state it carries between calls."""

    def __init__(self, path: str, *, runner: str = "ort", threads: int | None = None, sizes: dict | None = None,
                 embed: str | None = None):
        """`sizes`: values of symbolic state dimensions other than the batch and the past length
        (onnxruntime-genai's builder names the head size ``kv_cache_dim``); the others are 0.
        `embed`: an ``embed_tokens`` model (input_ids -> inputs_embeds) run before a decoder
        that takes ``inputs_embeds`` (transformers.js's text-only pair)."""
        self.sizes = dict(sizes or {})
        self.embed = None if embed is None else DecoderSession._open(embed, runner, threads)
        model = onnx.load(path, load_external_data=False)
        self.inputs = [(i.name, [d.dim_value if d.HasField("dim_value") else d.dim_param
                                 for d in i.type.tensor_type.shape.dim], _NUMPY[i.type.tensor_type.elem_type])
                       for i in model.graph.input]
        self.outputs = [o.name for o in model.graph.output]
        names = {name for name, _, _ in self.inputs}
        # present -> past: deltarule's names (present_conv.i -> past_conv.i, present.i.key ->
        # past_key_values.i.key) and onnxruntime-genai's builder's (present.i.conv -> past.i.conv)
        self.feedback = {}
        for out in self.outputs[1:]:
            rest = out[len("present"):]
            found = [c for c in ("past" + rest, "past_key_values" + rest) if c in names]
            if not found:
                raise ValueError(f"{path}: output {out!r} has no past input")
            self.feedback[out] = found[0]
        positions = [shape for name, shape, _ in self.inputs if name == "position_ids"]
        self.positions = bool(positions)                  # deltarule's Qwen3.5 exports take none
        self.mrope = self.positions and positions[0][0] == 3
        self.session = DecoderSession._open(path, runner, threads)

    @staticmethod
    def _open(path: str, runner: str, threads: int | None):
        if runner == "ort":
            import onnxruntime as ort
            options = ort.SessionOptions()
            if threads:
                options.intra_op_num_threads = threads
            return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        if runner == "deltarule":
            from ..onnx import Session
            return Session(path)
        if runner == "reference":
            from onnx.reference import ReferenceEvaluator
            return ReferenceEvaluator(path)
        raise ValueError(f"runner: 'ort' | 'deltarule' | 'reference', not {runner!r}")

    def zero_state(self, batch: int) -> dict:
        """The first step's past: zeros, past length 0 (every symbolic size but the batch and `sizes`)."""
        state = {}
        for name, shape, dtype in self.inputs:
            if name.startswith("past"):
                state[name] = np.zeros([batch if d == "batch_size" else (d if isinstance(d, int) else
                                                                          self.sizes.get(d, 0)) for d in shape],
                                       dtype=dtype)
        return state

    def step(self, ids: np.ndarray, mask: np.ndarray, past: dict) -> tuple[np.ndarray, dict]:
        """One call: ids [B, T], mask [B, past + T] -> (logits [B, T, vocab], the present state
        under the past's names)."""
        B, T = ids.shape
        P = mask.shape[1] - T
        pos = np.broadcast_to(np.arange(P, P + T, dtype=np.int64), (B, T))
        if self.mrope:
            pos = np.broadcast_to(pos, (3, B, T))
        types = {name: dtype for name, _, dtype in self.inputs}
        if self.embed is not None:
            first = {"inputs_embeds": self.embed.run(None, {"input_ids": ids.astype(np.int64)})[0]}
        else:
            first = {"input_ids": ids.astype(types["input_ids"])}
        feeds = {**first, "attention_mask": mask.astype(types["attention_mask"]), **past}
        if self.positions:
            feeds["position_ids"] = np.ascontiguousarray(pos, dtype=types["position_ids"])
        out = dict(zip(self.outputs, self.session.run(None, feeds)))
        return out["logits"], {self.feedback[name]: value for name, value in out.items() if name != "logits"}

    def greedy(self, prompt: np.ndarray, max_new_tokens: int, *, eos_token_id: int | None = None,
               pad_token_id: int = 0) -> np.ndarray:
        """Greedy tokens after `prompt` [B, T] (no padding): [B, max_new_tokens]. A row that
        produced `eos_token_id` continues with `pad_token_id` (as transformers' ``generate``)."""
        B = prompt.shape[0]
        past, ids, tokens = self.zero_state(B), prompt, []
        mask = np.ones((B, prompt.shape[1]), dtype=np.int64)
        done = np.zeros(B, dtype=bool)
        for _ in range(max_new_tokens):
            logits, past = self.step(ids, mask, past)
            next_ids = np.where(done, pad_token_id, logits[:, -1].argmax(-1)).astype(np.int64)
            if eos_token_id is not None:
                done |= next_ids == eos_token_id
            ids = next_ids[:, None]
            tokens.append(ids)
            mask = np.ones((B, mask.shape[1] + 1), dtype=np.int64)
        return np.concatenate(tokens, axis=1)
