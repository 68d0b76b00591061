"""The op contracts of the three WebGPU kernel cards, as `manifest.json` data.

Every input and output has a bind key (the name a JavaScript caller uses), a
logical dtype variable, an optional rank, and a presence rule the loader
checks before any work:

- ``"required"`` / ``"optional"``;
- ``{"exactly_when": {attribute: [values]}}``: present exactly when the
  attribute takes one of the values (absent otherwise);
- ``{"optional": true, "requires_rank": {bind: r}}``: may be present only when
  another input has rank r;
- ``{"optional": true, "with": [binds]}``: present only together with those.

``"host": true`` marks inputs whose values shape the dispatch (offsets, slab
rows, per-head gate parameters): they are typed arrays on the host even when
the other inputs are device buffers. Shapes beyond rank are checked by the
card's host program (`host.js`), which names the bind key in its errors.
"""

from __future__ import annotations

# gate_activation values with a raw gate (a_log, dt_bias): ONNX Runtime 1.32's names and aliases
_RAW_GATES = ["softplus", "qwen", "sigmoid", "kda"]
# state_update_capacity's range in ONNX Runtime 1.32's schema
MAX_CAPACITY = 8

GATED_DELTA_NET = {
    "id": "com.microsoft.GatedDeltaNet",
    "domain": "com.microsoft",
    "op": "GatedDeltaNet",
    "since_version": 1,
    "description": (
        "Token-major gated delta network with an explicit recurrent state: "
        "S_t = exp(g_t) * S_{t-1} + k_t * (beta_t * (v_t - exp(g_t) * S_{t-1}^T k_t))^T and "
        "o_t = scale * S_t^T q_t per value head; update_rule selects which terms survive. Query, key and "
        "value are (total_tokens, heads, head_size) or (batch, sequence, heads, head_size). num_heads_v is "
        "a positive multiple of num_heads_q, and value head h reads query head h * num_heads_q / num_heads_v. "
        "The V-major state and the gate fusions are float32. As in ONNX Runtime 1.32: per-key-dimension "
        "decay (decay (..., num_heads_v, head_size_qk)) and compact transition capture "
        "(state_update_capacity C > 0 with capture_count: request b's first min(capture_count[b], C, "
        "its length) transitions in state_update, row b = [C decay rows | C keys | C deltas], so that "
        "S = diag(decay) S + key delta^T replays them; the rest of the row is zero)."),
    "inputs": [
        {"name": "query", "bind": "queryT", "type": "T", "rank": [3, 4], "presence": "required",
         "description": "(total_tokens, num_heads_q, head_size_qk) or (batch_size, sequence_length, "
                        "num_heads_q, head_size_qk)"},
        {"name": "key", "bind": "keyT", "type": "T", "rank": [3, 4], "presence": "required",
         "description": "exactly query's shape; L2-normalized (or qk_l2_norm=1) for the delta rules"},
        {"name": "value", "bind": "valueT", "type": "T", "rank": [3, 4], "presence": "required",
         "description": "(..., num_heads_v, head_size_v) over query's leading token axes"},
        {"name": "cu_seqlens", "bind": "cuSeqlensT", "type": "TI", "rank": [1], "host": True,
         "presence": {"optional": True, "requires_rank": {"queryT": 3}},
         "description": "(batch_size + 1) exclusive prefix sums; clamped to [0, total_tokens]: a decreasing "
                        "or out-of-range entry yields an empty request. Absent: uniform packing (rank 3 takes "
                        "the batch size from initialStateT)"},
        {"name": "decay", "bind": "decayT", "type": "TS", "presence": {"exactly_when": {
            "update_rule": ["gated", "gated_delta"]}},
         "description": "log-space decay (..., num_heads_v), or per key dimension (..., num_heads_v, "
                        "head_size_qk); the raw projection with a gate_activation"},
        {"name": "beta", "bind": "betaT", "type": "TS", "presence": {"exactly_when": {
            "update_rule": ["delta", "gated_delta"]}},
         "description": "update rate (..., num_heads_v)"},
        {"name": "initial_state", "bind": "initialStateT", "type": "TS", "rank": [4], "presence": "optional",
         "description": "V-major (batch_size, num_heads_v, head_size_v, head_size_qk); zeros when absent; "
                        "a separate allocation from finalStateT"},
        {"name": "a_log", "bind": "aLogT", "type": "TS", "rank": [1], "host": True,
         "presence": {"exactly_when": {"gate_activation": _RAW_GATES}}, "description": "(num_heads_v)"},
        {"name": "dt_bias", "bind": "dtBiasT", "type": "TS", "rank": [1, 2], "host": True,
         "presence": {"exactly_when": {"gate_activation": _RAW_GATES}},
         "description": "(num_heads_v); with per-key decay also (num_heads_v, head_size_qk) or "
                        "(num_heads_v * head_size_qk)"},
        {"name": "capture_count", "bind": "captureCountT", "type": "TI", "rank": [1], "host": True,
         "presence": {"exactly_when": {"state_update_capacity": list(range(1, MAX_CAPACITY + 1))}},
         "description": "(batch_size): transitions to capture per request, clamped to [0, min(C, its length)]"},
        {"name": "state_update_active", "bind": "stateUpdateActiveT", "type": "TI", "rank": [1], "host": True,
         "presence": "optional",
         "description": "(1): 0 disables the capture (state_update stays zero); absent means active"},
    ],
    "outputs": [
        {"name": "output", "bind": "outputT", "type": "T", "rank": "same as queryT", "presence": "required",
         "description": "(..., num_heads_v, head_size_v) over query's leading axes"},
        {"name": "final_state", "bind": "finalStateT", "type": "TS", "rank": [4], "presence": "required",
         "description": "V-major (batch_size, num_heads_v, head_size_v, head_size_qk); a request with no "
                        "tokens copies its incoming state through"},
        {"name": "state_update", "bind": "stateUpdateT", "type": "TS", "rank": [2],
         "presence": {"optional": True, "with": ["captureCountT"]},
         "description": "(batch_size, C * (decay_width + num_heads_q * head_size_qk + num_heads_v * head_size_v)), "
                        "decay_width num_heads_v (num_heads_v * head_size_qk per key): row b holds C decay "
                        "factors exp(g) [decay_width] (1 without decay), then C keys as the recurrence uses "
                        "them (L2-normalized with qk_l2_norm) [num_heads_q, head_size_qk], then C deltas "
                        "beta (v - S'^T k) (v without beta) [num_heads_v, head_size_v], S' the decayed state; "
                        "past the captured prefix zeros"},
    ],
    "attributes": [
        {"name": "beta_activation", "type": "string", "default": "none", "values": ["none", "sigmoid"]},
        {"name": "chunk_size", "type": "int", "default": 64,
         "description": "scheduling hint for the chunked prefill; every value is accepted and none changes "
                        "the result beyond rounding"},
        {"name": "gate_activation", "type": "string", "default": "none", "values": ["none", *_RAW_GATES],
         "description": "softplus (alias qwen): -exp(a_log) * softplus(decay + dt_bias); sigmoid (alias kda): "
                        "gate_lower_bound * sigmoid(exp(a_log) * (decay + dt_bias)); in float32"},
        {"name": "gate_lower_bound", "type": "float", "default": -5.0,
         "description": "negative and finite; the bound of the sigmoid gate"},
        {"name": "qk_l2_norm", "type": "int", "default": 0, "values": [0, 1],
         "description": "1: x * rsqrt(sum(x^2) + eps) per query and key head, in float32; eps 1e-12, 1e-6 "
                        "with the sigmoid / kda gate (ONNX Runtime 1.32's CPU kernel)"},
        {"name": "scale", "type": "float", "default": 0.0, "description": "0 selects 1 / sqrt(head_size_qk)"},
        {"name": "state_update_capacity", "type": "int", "default": 0, "values": list(range(MAX_CAPACITY + 1)),
         "description": "C, transitions per request in state_update (ONNX Runtime's range [0, 8]); 0 disables "
                        "the capture. A capture runs the recurrent variant (never the chunked one), with a "
                        "storage buffer of its own where the adapter has one to spare, else after the "
                        "outputs in a shared one"},
        {"name": "update_rule", "type": "string", "default": "gated_delta",
         "values": ["linear", "gated", "delta", "gated_delta"]},
    ],
    "type_constraints": {"T": ["float32", "float16"], "TS": ["float32"], "TI": ["int32"]},
}

LINEAR_ATTENTION_GATE = {
    "id": "com.microsoft.LinearAttentionGate",
    "domain": "com.microsoft",
    "op": "LinearAttentionGate",
    "since_version": 1,
    "description": (
        "The gate projections of com.microsoft.LinearAttention's gated-delta recurrence: "
        "decay = decay_scale * softplus(a + dt_bias) and, when requested, beta = sigmoid(b). The last "
        "input axis is the head axis; gate arithmetic is float32, narrowed only on store. Requesting beta "
        "requires b; an unconsumed b is permitted when beta is omitted."),
    "inputs": [
        {"name": "a", "bind": "aT", "type": "T", "presence": "required",
         "description": "decay gate projection (..., H), rank >= 1"},
        {"name": "dt_bias", "bind": "dtBiasT", "type": "TF", "rank": [1], "presence": "required", "host": True,
         "description": "(H)"},
        {"name": "decay_scale", "bind": "decayScaleT", "type": "TF", "rank": [1], "presence": "required",
         "host": True,
         "description": "(H); -exp(A_log) for Gated DeltaNet"},
        {"name": "b", "bind": "bT", "type": "T", "presence": "optional",
         "description": "update-rate projection, a's shape; unused when beta is not requested"},
    ],
    "outputs": [
        {"name": "decay", "bind": "decayT", "type": "T", "rank": "same as aT", "presence": "required"},
        {"name": "beta", "bind": "betaT", "type": "T", "rank": "same as aT",
         "presence": {"optional": True, "with": ["bT"]},
         "description": "sigmoid(b); requested by default when bT is given"},
    ],
    "attributes": [],
    "type_constraints": {"T": ["float32", "float16"], "TF": ["float32"]},
}

LINEAR_ATTENTION = {
    "id": "deltarule.LinearAttention",
    "domain": "deltarule",
    "op": "LinearAttention",
    "since_version": 1,
    "description": (
        "deltarule's generalized gated delta rule (docs/design.md). Per sequence and state head, state S "
        "[K, V]: S' = diag(exp(gk_t + g_t)) S_{t-1}; S_t = S' + k_t (w_t * v_t - S'^T (b_t * k_t))^T; "
        "o_t = scale * S_t^T q_t, with b = erase (or beta) and w = write (or beta). Covers what "
        "com.microsoft.GatedDeltaNet cannot express: per-key decay with or without a scalar decay (KDA, "
        "RGDR), Gated DeltaNet-2's erase / write gates, GQA and GVA, and a state slab with row indices and "
        "speculative per-token rows, updated in place."),
    "inputs": [
        {"name": "q", "bind": "qT", "type": "T", "rank": [4], "presence": "required",
         "description": "[B, T, Hq, K]"},
        {"name": "k", "bind": "kT", "type": "T", "rank": [4], "presence": "required",
         "description": "[B, T, Hk, K]"},
        {"name": "v", "bind": "vT", "type": "T", "rank": [4], "presence": "required",
         "description": "[B, T, Hv, V]; Hv a multiple of Hk; Hq == Hk (GVA) or a multiple of Hv == Hk (GQA)"},
        {"name": "g", "bind": "gT", "type": "TG", "rank": [3], "presence": "optional",
         "description": "[B, T, Hv] scalar log decay (<= 0, -inf resets); with gkT or alone, exactly for "
                        "rules gated / gated_delta"},
        {"name": "gk", "bind": "gkT", "type": "TG", "rank": [4], "presence": "optional",
         "description": "[B, T, Hv, K] per-key log decay"},
        {"name": "beta", "bind": "betaT", "type": "TG", "rank": [3], "presence": "optional",
         "description": "[B, T, Hv]; or the pair eraseT / writeT; exactly for rules delta / gated_delta"},
        {"name": "erase", "bind": "eraseT", "type": "TG", "rank": [4],
         "presence": {"optional": True, "with": ["writeT"]}, "description": "[B, T, Hv, K]"},
        {"name": "write", "bind": "writeT", "type": "TG", "rank": [4],
         "presence": {"optional": True, "with": ["eraseT"]}, "description": "[B, T, Hv, V]"},
        {"name": "initial_state", "bind": "initialStateT", "type": "TS", "rank": [4], "presence": "optional",
         "description": "[N, Hv, K, V] (kv) or [N, Hv, V, K] (vk); zeros when absent. With stateIndicesT a "
                        "slab [S, Hv, ...], updated in place on the device (stateT is the same buffer)"},
        {"name": "cu_seqlens", "bind": "cuSeqlensT", "type": "TI", "rank": [1], "host": True,
         "presence": "optional", "description": "[N + 1] packed offsets, B == 1; clamped to [0, T]"},
        {"name": "seq_lens", "bind": "seqLensT", "type": "TI", "rank": [1], "host": True,
         "presence": "optional", "description": "[B] lengths in [0, T]; excludes cuSeqlensT"},
        {"name": "state_indices", "bind": "stateIndicesT", "type": "TI", "rank": [1, 2], "host": True,
         "presence": {"optional": True, "with": ["initialStateT"]},
         "description": "[N] distinct slab rows (negative: padding), or [N, L] per-token rows (speculative "
                        "decoding, read from column numAcceptedTokens - 1)"},
        {"name": "num_accepted_tokens", "bind": "numAcceptedTokensT", "type": "TI", "rank": [1], "host": True,
         "presence": {"optional": True, "with": ["stateIndicesT"]}, "description": "[N] counts in [1, L]"},
        {"name": "A_log", "bind": "aLogT", "type": "TF", "rank": [1], "host": True,
         "presence": {"optional": True, "with": ["dtBiasT"]},
         "description": "[Hv]: gT (or gkT) is the raw projection, decay -exp(A_log) softplus(g + dt_bias)"},
        {"name": "dt_bias", "bind": "dtBiasT", "type": "TF", "rank": [1, 2], "host": True,
         "presence": {"optional": True, "with": ["aLogT"]}, "description": "[Hv] beside gT, [Hv, K] beside gkT"},
    ],
    "outputs": [
        {"name": "o", "bind": "oT", "type": "T", "rank": [4], "presence": "required",
         "description": "[B, T, max(Hq, Hv), V]; tokens outside every sequence are zero"},
        {"name": "state", "bind": "stateT", "type": "TS", "rank": [4], "presence": "required",
         "description": "[N, Hv, ...] final states, or the slab itself (in place) with stateIndicesT"},
    ],
    "attributes": [
        {"name": "rule", "type": "string", "default": "gated_delta",
         "values": ["linear", "gated", "delta", "gated_delta"]},
        {"name": "scale", "type": "float", "default": 0.0, "description": "0 selects K ** -0.5"},
        {"name": "state_layout", "type": "string", "default": "kv", "values": ["kv", "vk"]},
        {"name": "qk_l2norm", "type": "int", "default": 0, "values": [0, 1]},
        {"name": "l2norm_eps", "type": "float", "default": 1e-6},
        {"name": "beta_sigmoid", "type": "int", "default": 0, "values": [0, 1]},
        {"name": "chunk_size", "type": "int", "default": 64},
    ],
    "type_constraints": {"T": ["float32", "float16", "bfloat16"], "TG": ["float32", "float16", "bfloat16"],
                         "TS": ["float32"], "TF": ["float32"], "TI": ["int32"]},
}

ALL = (GATED_DELTA_NET, LINEAR_ATTENTION_GATE, LINEAR_ATTENTION)
