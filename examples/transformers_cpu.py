"""Generate with a transformers hybrid model on CPU, with and without deltarule.

Builds a random-weight model shaped like Qwen3.5-0.8B's layers (8 of its layers:
6 Gated DeltaNet, 2 full attention; nothing is downloaded), then runs the same
greedy generation on transformers' own PyTorch fallback and on deltarule, and
prints both times and whether the tokens agree.

    python examples/transformers_cpu.py                 # the 0.8B-like model, 256 + 32 tokens
    python examples/transformers_cpu.py --small         # a small model, seconds

Needs transformers >= 5 (pip install 'deltarule[bench]').
"""

import argparse
import time

import torch
import transformers

import deltarule.integrations.transformers as dt


def build(small: bool) -> transformers.PreTrainedModel:
    layers = (["linear_attention"] * 3 + ["full_attention"]) * 2
    if small:
        sizes = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=4,
                     linear_key_head_dim=64, linear_value_head_dim=64)
    else:
        sizes = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                     linear_key_head_dim=128, linear_value_head_dim=128)
    config = transformers.Qwen3_5TextConfig(num_hidden_layers=len(layers), layer_types=layers,
                                            linear_conv_kernel_dim=4, tie_word_embeddings=True, **sizes)
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(config).eval()


def generate(model, prompt, new_tokens):
    start = time.perf_counter()
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=0)
    return tokens, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a small model instead of the 0.8B-like one")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    model = build(args.small)
    prompt = torch.randint(3, model.config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(1))

    # transformers' own PyTorch fallback (even where fla is installed: its GPU kernels fail on a CPU)
    with dt.torch_fallback():
        reference, fallback_s = generate(model, prompt, args.new_tokens)

    found = dt.enable().bound      # every family of the installed transformers now runs on deltarule
    print(f"deltarule bound {len(found)} names in {len({b.family for b in found})} model families")
    tokens, deltarule_s = generate(model, prompt, args.new_tokens)
    dt.disable()

    print(f"generate {args.prompt_tokens} + {args.new_tokens} tokens: fallback {fallback_s:.2f} s, "
          f"deltarule {deltarule_s:.2f} s ({fallback_s / deltarule_s:.2f}x)")
    print("greedy tokens equal:", torch.equal(tokens, reference))
    return 0 if torch.equal(tokens, reference) else 1


if __name__ == "__main__":
    raise SystemExit(main())
