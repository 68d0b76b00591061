"""One vLLM engine run for tests/test_vllm.py and benchmarks/vllm.py (a process of its own:
vLLM registers its ops once per process).

    python -m deltarule.tools.bench.vllm_engine '{"model": DIR, "dtype": "float32", "deltarule": true, ...}'

Prints one line ``RESULT {json}``: the generated token ids of every prompt of every round
(a round is one ``LLM.generate`` call; later rounds hit the prefix cache of earlier ones),
the prompt tokens each took from the prefix cache, the seconds each round took, and whether
the engine kept prefix caching on (vLLM-CPU turns it off for MLA models on CPUs without AMX). Keys: model, dtype, deltarule (bool), prompts (lists of
token ids, per round), max_tokens (an int, or one per round), speculative (ngram draft
tokens, 0: off), prefix_caching, max_num_batched_tokens, max_num_seqs, time_gdn (also report
the seconds spent in vLLM's GDN core op per round, deltarule's or vLLM's own, as
[[seconds, calls] of steps with more tokens than max_num_seqs (prefill), [seconds, calls] of
the others (decode)]; needs the engine in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0,
which it then sets), in_process (the engine in this process without timing), tensor_parallel_size.
"""

import importlib
import json
import os
import sys
import time

GDN_SECONDS = [[0.0, 0], [0.0, 0]]          # prefill steps, decode steps


def _time_gdn(decode_tokens: int) -> None:
    """Wrap the function behind vllm::cpu_gdn_attention_core (before vLLM registers it); a call
    of at most `decode_tokens` tokens counts as decode."""
    import deltarule.integrations.vllm as dv
    module = importlib.import_module(dv.HOOKED_MODULE)
    inner = getattr(module, dv.HOOKED_FUNCTION)

    def timed(mixed_qkv, b, a, core_attn_out, layer_name):
        start = time.perf_counter()
        inner(mixed_qkv, b, a, core_attn_out, layer_name)
        kind = GDN_SECONDS[mixed_qkv.shape[0] <= decode_tokens]
        kind[0] += time.perf_counter() - start
        kind[1] += 1

    setattr(module, dv.HOOKED_FUNCTION, dv.adopt_schema(timed, inner))


def main(spec: dict) -> dict:
    if spec.get("time_gdn") or spec.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if spec.get("deltarule"):
        import deltarule.integrations.vllm as dv
        assert dv.enable(), "the plugin did not hook vLLM"   # also sets DELTARULE_VLLM=1 for engine processes
    if spec.get("time_gdn"):
        _time_gdn(spec.get("max_num_seqs", 8))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {}
    if spec.get("speculative"):
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec["speculative"],
                                       "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if spec.get("max_num_batched_tokens"):
        extra["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if spec.get("tensor_parallel_size", 1) > 1:         # one worker process per rank
        extra.update(tensor_parallel_size=spec["tensor_parallel_size"], distributed_executor_backend="mp")
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"],
              max_model_len=spec.get("max_model_len", 512), enforce_eager=True,
              max_num_seqs=spec.get("max_num_seqs", 8), seed=0,
              enable_prefix_caching=spec.get("prefix_caching", True), **extra)
    limits = spec["max_tokens"]
    limits = limits if isinstance(limits, list) else [limits] * len(spec["prompts"])
    rounds, cached, seconds, gdn = [], [], [], []
    for prompts, limit in zip(spec["prompts"], limits):
        params = SamplingParams(max_tokens=limit, temperature=0, detokenize=False, ignore_eos=True)
        GDN_SECONDS[:] = [[0.0, 0], [0.0, 0]]
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        gdn.append([list(kind) for kind in GDN_SECONDS])
        rounds.append([list(o.outputs[0].token_ids) for o in outs])
        cached.append([o.num_cached_tokens or 0 for o in outs])
    config = llm.llm_engine.vllm_config
    return {"tokens": rounds, "cached": cached, "seconds": seconds, "gdn": gdn,
            "prefix_caching": bool(config.cache_config.enable_prefix_caching)}


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
