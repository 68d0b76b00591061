"""Hooks that put deltarule under other libraries' models.

- `deltarule.integrations.transformers`: the linear-attention layers of
  transformers' hybrid models (Qwen3-Next, Qwen3.5, Kimi Linear, ...) run on
  deltarule after `enable()`.
  `deltarule.integrations.hf_kernels` holds its layers for HF `kernels`
  (transformers >= 5.25), and `deltarule.integrations.drop_ins` the calls both
  make (deltarule's fla drop-ins as transformers calls fla, `causal_conv1d`).

Each submodule is imported explicitly; importing this package loads none of them
(nor the library it hooks into).
"""
