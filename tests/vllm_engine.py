"""One vLLM engine run for tests/test_vllm.py and benchmarks/vllm.py (a process of its own:
vLLM's op registration and its engine processes are per process).

    python tests/vllm_engine.py '{"model": DIR, "dtype": "float32", "deltarule": true, ...}'

Prints one line ``RESULT {json}``: the generated token ids of every prompt of every round
(a round is one ``LLM.generate`` call; later rounds hit the prefix cache of earlier ones),
the prompt tokens each took from the prefix cache, and the seconds each round took. Keys: model, dtype, deltarule (bool), prompts (lists of
token ids, per round), max_tokens, speculative (ngram draft tokens, 0: off), prefix_caching,
max_num_batched_tokens, max_num_seqs.
"""

import json
import os
import sys
import time


def main(spec: dict) -> dict:
    if spec.get("deltarule"):
        import deltarule.integrations.vllm as dv
        dv.enable()                       # also sets DELTARULE_VLLM=1 for vLLM's engine processes
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {}
    if spec.get("speculative"):
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec["speculative"],
                                       "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if spec.get("max_num_batched_tokens"):
        extra["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"],
              max_model_len=spec.get("max_model_len", 512), enforce_eager=True,
              max_num_seqs=spec.get("max_num_seqs", 8), seed=0,
              enable_prefix_caching=spec.get("prefix_caching", True), **extra)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, detokenize=False, ignore_eos=True)
    rounds, cached, seconds = [], [], []
    for prompts in spec["prompts"]:
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        rounds.append([list(o.outputs[0].token_ids) for o in outs])
        cached.append([o.num_cached_tokens or 0 for o in outs])
    return {"tokens": rounds, "cached": cached, "seconds": seconds}


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
