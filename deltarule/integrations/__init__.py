"""Hooks that put deltarule under other libraries' models.

- `deltarule.integrations.transformers`: the linear-attention layers of
  transformers' hybrid models (Qwen3-Next, Qwen3.5, Kimi Linear, ...) run on
  deltarule after `enable()`.

Each submodule is imported explicitly; importing this package loads none of them
(nor the library it hooks into).
"""
