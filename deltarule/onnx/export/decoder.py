"""The decoder an export traces: a transformers causal LM as a function of plain tensors.

`Decoder(model)` takes ``input_ids`` (or ``inputs_embeds``), ``attention_mask``,
``position_ids`` (not Qwen3.5's: `MROPE`) and the past state as plain tensors, fills a
transformers `DynamicCache` from them, runs the model once, and returns ``logits`` and the present state read back from
the cache. One graph serves prefill and decode: the first step feeds zero states with a
past of length 0 (what transformers.js and onnxruntime-genai do).

The state of each layer (`StateLayout`, found by running the model once on two tokens and
reading its cache, so it follows the installed transformers):

- a full-attention layer i: key and value, [batch, heads, past, head_dim];
- a linear-attention layer i: the convolution's state [batch, channels, W - 1] (the W - 1
  inputs before the call; transformers' cache keeps W columns, the runtimes W - 1) and the
  recurrent state [batch, Hv, K, V] (a target ort-gpu graph takes and gives it V-major,
  [batch, Hv, V, K]: `StateLayout.v_major`). OLMo-Hybrid's is split in three at the query /
  key / value channels (transformers.js names three).

While a `Decoder` runs, transformers' kernelizable ``causal_conv1d_forward`` of the model's
modeling module is replaced by `deltarule.conv.causal_conv1d_with_state` (one op, ONNX's
``CausalConvWithState``) reading and writing the state the decoder put in the cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from dataclasses import dataclass

import torch

from ...conv import causal_conv1d_with_state
from ...errors import Unsupported

# the families whose position_ids are Qwen's multimodal [3, batch, sequence] (text: three equal
# rows). Their decoder takes no position_ids: it derives them from attention_mask (cumsum - 1,
# padding at 1, as transformers' generate does). transformers.js 4.3.2 computes the text-only
# mrope decode positions wrongly (rope delta max + 1 + length where transformers has
# max + 1 - length, models/qwen2_vl/modeling_qwen2_vl.js) and reads a vision_config for them;
# it computes none when the graph takes none.
MROPE = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# transformers.js names OLMo-Hybrid's conv state per projection
SPLIT_CONV = {"olmo_hybrid": ("query", "key", "value")}


@dataclass(frozen=True)
class Tensor:
    """One state tensor of the exported decoder: its input name (``past...``), output name
    (``present...``), and shape with ``None`` for the batch and the past length."""

    name: str
    present: str
    shape: tuple
    layer: int
    kind: str                     # "key" | "value" | "conv" | "recurrent"


@dataclass(frozen=True)
class StateLayout:
    """The state tensors of a model, in the order the decoder takes and returns them."""

    model_type: str
    tensors: tuple[Tensor, ...]
    conv_splits: dict             # layer -> channel widths of its split conv state (OLMo-Hybrid)
    dtype: torch.dtype
    # the recurrent state's layout: "kv" [batch, Hv, K, V] (transformers' and the traced
    # decoder's), "vk" [batch, Hv, V, K] (target ort-gpu's graph: `v_major`)
    recurrent: str = "kv"

    def v_major(self) -> "StateLayout":
        """This layout with the recurrent state V-major, [batch, Hv, V, K]: the state inputs and
        outputs of a target ort-gpu graph (`deltarule.onnx.export.fuse.v_major_state`). A description
        of the exported graph only: the decoder is traced with transformers' layout."""
        tensors = tuple(dataclasses.replace(t, shape=(*t.shape[:2], t.shape[3], t.shape[2]))
                        if t.kind == "recurrent" and self.recurrent == "kv" else t for t in self.tensors)
        return dataclasses.replace(self, tensors=tensors, recurrent="vk")

    @property
    def takes_positions(self) -> bool:
        """Whether the decoder takes position_ids (see `MROPE`)."""
        return self.model_type not in MROPE

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(sorted({t.layer for t in self.tensors if t.kind == "recurrent"}))



def text_config(config):
    return getattr(config, "text_config", None) or config


def state_layout(model) -> StateLayout:
    """The state of `model` (a transformers causal LM), read from its cache after a 2-token call."""
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
    config = text_config(model.config)
    model_type = config.model_type
    cache = DynamicCache(config=model.config)
    ids = torch.ones(1, 2, dtype=torch.long)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    tensors, splits = [], {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            if layer.number_of_states != 1:
                raise Unsupported(f"layer {i} of {model_type}: {layer.number_of_states} linear states per layer "
                                  f"(one expected)")
            conv, rec = layer.conv_states[0], layer.recurrent_states[0]
            C, W = conv.shape[1], conv.shape[2]
            parts = SPLIT_CONV.get(model_type)
            if parts:
                attn = model.get_submodule(_linear_module(model, i))
                widths = (attn.key_dim, attn.key_dim, attn.value_dim)
                splits[i] = widths
                tensors += [Tensor(f"past_conv.{i}.{p}", f"present_conv.{i}.{p}", (None, w, W - 1), i, "conv")
                            for p, w in zip(parts, widths)]
            else:
                tensors.append(Tensor(f"past_conv.{i}", f"present_conv.{i}", (None, C, W - 1), i, "conv"))
            tensors.append(Tensor(f"past_recurrent.{i}", f"present_recurrent.{i}", (None, *rec.shape[1:]), i,
                                  "recurrent"))
        elif getattr(layer, "keys", None) is not None and hasattr(layer, "values"):
            k, v = layer.keys, layer.values
            tensors.append(Tensor(f"past_key_values.{i}.key", f"present.{i}.key", (None, k.shape[1], None, k.shape[3]),
                                  i, "key"))
            tensors.append(Tensor(f"past_key_values.{i}.value", f"present.{i}.value",
                                  (None, v.shape[1], None, v.shape[3]), i, "value"))
        else:
            raise Unsupported(f"layer {i} of {model_type}: cache layer {type(layer).__name__} has neither keys / "
                              f"values nor linear-attention states")
    return StateLayout(model_type, tuple(tensors), splits, next(model.parameters()).dtype)


def _linear_module(model, layer: int) -> str:
    """The name of linear-attention layer `layer`'s module (the one owning ``conv1d``)."""
    for name, module in model.named_modules():
        if name.endswith("conv1d") and f"layers.{layer}." in name + ".":
            return name.rsplit(".", 1)[0]
    raise Unsupported(f"layer {layer}: no module with a conv1d")


class Decoder(torch.nn.Module):
    """`model` (a transformers causal LM) as ``forward(ids_or_embeds, attention_mask, [position_ids,]
    *past) -> (logits, *present)``, the state in `layout`'s order (see the module docstring);
    position_ids only where `layout.takes_positions`."""

    def __init__(self, model, layout: StateLayout, *, embeds: bool = False):
        if layout.recurrent != "kv":
            raise ValueError("Decoder: trace with transformers' state layout (StateLayout.recurrent 'kv'); "
                             "v_major() describes an ort-gpu graph's inputs, not the traced function's")
        super().__init__()
        self.model = model
        self.layout = layout
        self.embeds = embeds

    def forward(self, ids, attention_mask, *args):
        from transformers import DynamicCache
        if self.layout.takes_positions:
            position_ids, past = args[0], args[1:]
        else:                                   # Qwen3.5's text positions, from the mask (MROPE)
            positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
            position_ids = positions[:, positions.shape[1] - ids.shape[1]:][None].expand(3, -1, -1)
            past = args
        cache = DynamicCache(config=self.model.config)
        states = {}                      # layer -> conv state [B, C, W - 1] the conv op reads and replaces
        by_layer = {}
        for t, x in zip(self.layout.tensors, past):
            by_layer.setdefault(t.layer, {}).setdefault(t.kind, []).append(x)
        for i, layer in enumerate(cache.layers):
            entry = by_layer[i]
            if "key" in entry:
                k, v = entry["key"][0], entry["value"][0]
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
            else:
                conv = torch.cat(entry["conv"], dim=1) if len(entry["conv"]) > 1 else entry["conv"][0]
                rec = entry["recurrent"][0]
                layer.lazy_initialization(conv_states=conv, recurrent_states=rec, conv_kernel_size=conv.shape[-1] + 1)
                states[i] = conv
                layer.conv_states[0] = None         # read through `states` only
                layer.recurrent_states[0] = rec.clone()     # transformers copies the new state into it
                layer.has_previous_state[0] = True
        key = "inputs_embeds" if self.embeds else "input_ids"
        with _conv_forward(self.model, states):
            out = self.model(**{key: ids}, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, use_cache=True)
        present, split = [], {}
        for t in self.layout.tensors:
            layer = cache.layers[t.layer]
            if t.kind == "conv":                   # a split state (OLMo-Hybrid): its parts in order
                widths = self.layout.conv_splits.get(t.layer)
                if widths and t.layer not in split:
                    split[t.layer] = list(torch.split(states[t.layer], widths, dim=1))
                present.append(split[t.layer].pop(0) if widths else states[t.layer])
            elif t.kind == "recurrent":
                present.append(layer.recurrent_states[0])
            else:
                present.append(layer.keys if t.kind == "key" else layer.values)
        return (out.logits, *present)


@contextlib.contextmanager
def _conv_forward(model, states: dict | None):
    """Replace the model's ``causal_conv1d_forward`` by the conv op on `states` (layer -> [B, C,
    W - 1], replaced by the new state)."""
    module = importlib.import_module(type(model).__module__)
    if not hasattr(module, "causal_conv1d_forward"):
        raise Unsupported(f"{module.__name__} has no causal_conv1d_forward (transformers >= 5.25 has one in every "
                          f"hybrid family's modeling file)")

    def forward(conv1d, hidden_states, cache, layer_idx, activation=None, state_idx=0, **kwargs):
        y, states[layer_idx] = causal_conv1d_with_state(hidden_states, conv1d.weight.squeeze(1), conv1d.bias,
                                                         states[layer_idx], activation=activation)
        return y

    # the layers call it by its module-level name (a kernels Func or a plain function)
    saved = module.causal_conv1d_forward
    module.causal_conv1d_forward = forward
    try:
        yield
    finally:
        module.causal_conv1d_forward = saved
