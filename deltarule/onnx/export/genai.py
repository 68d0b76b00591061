"""``genai_config.json``: the file onnxruntime-genai (0.18) reads to run an exported decoder.

It names the model type (which of genai's model classes drives the decoder), the graph file
(relative to the folder: ``onnx/model.onnx`` works), the head counts and sizes, the special
token ids, and every input and output; the state names are ``%d`` templates filled with the
layer index. genai finds the linear-attention layers by matching the graph's inputs against
the ``past_conv_names`` template and reads the state shapes and dtypes from the graph.

- Model type: Qwen3.5 (dense / MoE) is genai's ``qwen3_5_text`` / ``qwen3_5_moe_text``; every
  other family is genai's generic ``decoder``. deltarule's Qwen3.5 decoder takes no
  ``position_ids`` (it derives them from the mask: `deltarule.onnx.export.decoder.MROPE`), so the
  config names none for it.
- Our full-attention layers concatenate the past and the new key / value, so the past and
  present buffers are not shared (``past_present_share_buffer``: false; genai's own builder
  emits GroupQueryAttention, which can share them).
- No tokenizer is needed to generate from token ids (``og.Model`` / ``og.Generator``).
- genai 0.18 cannot run a model with several convolution states per linear layer (OLMo-Hybrid:
  genai takes one template) nor one whose attention key and value differ in width (the MLA
  caches of Kimi Linear and Bailing-Hybrid: genai sizes both from the key): `genai_config`
  raises `deltarule.Unsupported` for them, read from the export's state layout.
"""

from __future__ import annotations

from ...errors import Unsupported

# deltarule's export names (deltarule.onnx.export.decoder.StateLayout)
STATE_NAMES = {
    "past_key": "past_key_values.%d.key", "past_value": "past_key_values.%d.value",
    "present_key": "present.%d.key", "present_value": "present.%d.value",
    "past_conv": "past_conv.%d", "past_recurrent": "past_recurrent.%d",
    "present_conv": "present_conv.%d", "present_recurrent": "present_recurrent.%d",
}

# transformers' model_type -> genai's; the others are "decoder"
MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_text": "qwen3_5_text",
               "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5_moe_text": "qwen3_5_moe_text"}


def unsupported(layout) -> str | None:
    """Why genai 0.18 cannot run an export of this `deltarule.onnx.export.decoder.StateLayout`, or None."""
    if layout.conv_splits:
        return "several convolution states per linear layer (genai names one)"
    widths = {t.kind: t.shape[-1] for t in layout.tensors if t.kind in ("key", "value")}
    if widths and widths["key"] != widths["value"]:
        return (f"an attention cache whose key and value differ in width ({widths['key']} and "
                f"{widths['value']}; genai sizes both as the key)")
    return None


def genai_config(config, layout, *, filename: str, state_names: dict, context_length: int | None = None) -> dict:
    """The ``genai_config.json`` (as a dict) of the decoder `filename` (relative to the folder)
    exported from the model whose transformers config is `config` and state layout `layout`
    (`deltarule.onnx.export.decoder.StateLayout`), its state named by
    `state_names` (the keys of `STATE_NAMES`, each a ``%d`` template). `context_length`: the
    longest sequence genai generates (default: the model's ``max_position_embeddings``).

    Raises:
        deltarule.Unsupported: a family onnxruntime-genai 0.18 cannot run (module docstring).
    """
    text = getattr(config, "text_config", None) or config
    reason = unsupported(layout)
    if reason:
        raise Unsupported(f"onnxruntime-genai 0.18 cannot run {text.model_type}: {reason}")
    context_length = context_length or text.max_position_embeddings
    eos = text.eos_token_id
    pad = text.pad_token_id if text.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    return {
        "model": {
            "type": MODEL_TYPES.get(text.model_type, "decoder"),
            "bos_token_id": text.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "vocab_size": text.vocab_size,
            "context_length": context_length,
            "decoder": {
                "filename": filename,
                "head_size": text.head_dim,
                "hidden_size": text.hidden_size,
                "num_attention_heads": text.num_attention_heads,
                "num_hidden_layers": text.num_hidden_layers,
                "num_key_value_heads": text.num_key_value_heads,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           **({"position_ids": "position_ids"} if layout.takes_positions else {}),
                           **{f"{k}_names": state_names[k] for k in ("past_key", "past_value", "past_conv",
                                                                     "past_recurrent")}},
                "outputs": {"logits": "logits",
                            **{f"{k}_names": state_names[k] for k in ("present_key", "present_value",
                                                                      "present_conv", "present_recurrent")}},
            },
        },
        "search": {"do_sample": False, "num_beams": 1, "max_length": context_length,
                   "past_present_share_buffer": False},
    }
