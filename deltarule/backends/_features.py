"""What a backend covers, for `deltarule info` and `backend_info()`."""

# Every feature of the contract; a backend that covers all of it says so with
# `dict(EVERYTHING, devices=...)` and lists only what differs.
EVERYTHING = {
    "rules": "linear, gated, delta, gated_delta",
    "decay": "g, gk, g + gk, raw-gate arm (A_log, dt_bias)",
    "update": "beta, erase + write, beta_sigmoid",
    "heads": "GVA (Hv multiple of Hk), GQA (Hq multiple of Hv)",
    "batching": "dense, cu_seqlens, seq_lens, state slab (state_indices), reusable batch plans",
    "speculative": "2-D state_indices (per-token state rows), num_accepted_tokens",
    "dtypes": "float32, float16, bfloat16 inputs; float32, bfloat16, float16 state storage",
}
