"""``genai_config.json`` for onnxruntime-genai (0.18) running an exported decoder.

onnxruntime-genai reads the model from the folder's ``genai_config.json``: the model type
(which of its model classes drives the decoder), the graph file, the head counts and sizes,
the special token ids, and the name of every input and output. The state names are
``%d`` templates filled with the layer index; genai finds a model's linear-attention layers
by matching the graph's inputs against the ``past_conv_names`` template and reads the state
shapes and dtypes from the graph, so the templates are all it needs of them.

Our graphs' full-attention layers concatenate the past and the new key / value (the present
is one step longer than the past), so the past and present buffers cannot be shared
(``past_present_share_buffer``: false; onnxruntime-genai's own builder emits
GroupQueryAttention, which can).

genai runs a folder only with a ``tokenizer.json`` in it, even when it is fed token ids;
`write_tokenizer` makes one for a random checkpoint that has none.
"""

from __future__ import annotations

import json
import os

# deltarule's export names (deltarule.export.decoder.StateLayout)
STATE_NAMES = {
    "past_key": "past_key_values.%d.key", "past_value": "past_key_values.%d.value",
    "present_key": "present.%d.key", "present_value": "present.%d.value",
    "past_conv": "past_conv.%d", "past_recurrent": "past_recurrent.%d",
    "present_conv": "present_conv.%d", "present_recurrent": "present_recurrent.%d",
}

# transformers' model_type -> genai's model type (both take position_ids [3, batch, sequence])
MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_text": "qwen3_5_text",
               "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5_moe_text": "qwen3_5_moe_text"}


def genai_config(config, *, filename: str, state_names: dict, context_length: int | None = None) -> dict:
    """The ``genai_config.json`` of the decoder `filename` (relative to the folder) exported from
    a model whose transformers config is `config`, its state named by `state_names` (the keys of
    `STATE_NAMES`, each a ``%d`` template). `context_length`: the longest sequence generated
    (default: the model's ``max_position_embeddings``).

    Raises:
        deltarule.Unsupported: a model type onnxruntime-genai has no class for.
    """
    from ..errors import Unsupported
    text = getattr(config, "text_config", None) or config
    if text.model_type not in MODEL_TYPES:
        raise Unsupported(f"onnxruntime-genai 0.18 runs no {text.model_type!r} model "
                          f"(it runs {', '.join(sorted(set(MODEL_TYPES.values())))})")
    context_length = context_length or text.max_position_embeddings
    eos = text.eos_token_id
    pad = text.pad_token_id if text.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    return {
        "model": {
            "type": MODEL_TYPES[text.model_type],
            "bos_token_id": text.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "vocab_size": text.vocab_size,
            "context_length": context_length,
            "decoder": {
                "filename": filename,
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "head_size": text.head_dim,
                "hidden_size": text.hidden_size,
                "num_attention_heads": text.num_attention_heads,
                "num_hidden_layers": text.num_hidden_layers,
                "num_key_value_heads": text.num_key_value_heads,
                "inputs": {
                    "input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                    **{f"{key}_names": state_names[key] for key in ("past_key", "past_value", "past_conv",
                                                                    "past_recurrent")},
                },
                "outputs": {
                    "logits": "logits",
                    **{f"{key}_names": state_names[key] for key in ("present_key", "present_value", "present_conv",
                                                                    "present_recurrent")},
                },
            },
        },
        "search": {"do_sample": False, "num_beams": 1, "max_length": context_length,
                   "past_present_share_buffer": False},
    }


def write_tokenizer(directory: str, vocab_size: int) -> str:
    """Write a word-level ``tokenizer.json`` of `vocab_size` tokens (token i is the word ``t{i}``)
    to `directory`, for a random checkpoint without a tokenizer that onnxruntime-genai is to run
    on token ids. Returns its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()             # joins the words with spaces
    path = os.path.join(directory, "tokenizer.json")
    tokenizer.save(path)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30}, f)
    return path
