"""Train a small Qwen3.5 checkpoint on the CPU, its linear-attention layers on deltarule's kernels
and autograd, so that the ONNX exports' quantization quality can be measured on weights that
mean something (`benchmarks/export_quality.py`, docs/export.md "Quality of the quantized exports").

Model: transformers' ``Qwen3_5ForCausalLM`` (the text model; config built from
`deltarule.tools.bench.checkpoints.config("qwen3_5", "tiny")` with the sizes below): hidden 128,
4 layers (Gated DeltaNet x 3, then softmax attention), head dims 64, MLP 384, untied LM head.
`deltarule.integrations.transformers.enable()` is called before the model is built; the run stops
unless it reports the qwen3_5 layers bound.

Corpus: the Markdown the repository ships (README.md, NOTES.md, docs/*.md, sorted by path), as
bytes: token id = byte value (0-255), then ``<|pad|>`` 256, ``<|bos|>`` 257, ``<|eos|>`` 258 and
five reserved ids (vocabulary 264). Each file is split at 90 % of its bytes: the heads, each
followed by ``<|eos|>``, are the training split, the tails the validation split (every file
contributes to both; `corpus`).

Batches of 8 random windows of 256 + 1 tokens of the training split; AdamW (peak lr 3e-3,
betas 0.9 / 0.95, weight decay 0.1 on the matrices but the embedding), 20 warm-up steps then a
cosine decay to 10 % of the peak, gradient norm clipped at 1. The schedule runs over ``--steps``
when given (a deterministic run), else over the wall-clock ``--budget`` (seconds; the step count
then depends on the machine and on what else runs on it). On cores other jobs share, ``--threads
1`` is far faster than torch's default of one thread per core (measured here under a load of ~6
on 2 cores: 0.9 s a step against 6-14 s).
Seeded (torch, numpy, Python). Saved with ``save_pretrained`` (safetensors), with a byte-level
``tokenizer.json`` (the `tokenizers` library: a BPE without merges over the 256 byte-level
symbols, ids equal to the bytes) and its ``tokenizer_config.json`` (what onnxruntime-genai's
builder loads with ``AutoTokenizer``), ``training.json`` (sizes, steps, losses) and
``corpus.npz`` (the train and validation token ids as trained: the repository's files change
after; `saved_corpus`).

    .venv/bin/python benchmarks/train_checkpoint.py --out .onnx-models/quality/checkpoint --budget 240
    .venv/bin/python benchmarks/train_checkpoint.py --steps 600 --threads 1
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import random
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>")
PAD, BOS, EOS = 256, 257, 258
VOCAB = 264                                 # 256 bytes, 3 specials, 5 reserved (a multiple of 8)
VALIDATION = 0.10                           # the tail of each file
SIZES = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
             layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=2,
             linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
             max_position_embeddings=4096, tie_word_embeddings=False)
DEFAULT_OUT = os.path.join(ROOT, ".onnx-models", "quality", "checkpoint")


def corpus_files(root: str = ROOT) -> list[str]:
    """The Markdown the repository ships, sorted by path relative to `root`."""
    files = [os.path.join(root, "README.md"), os.path.join(root, "NOTES.md")]
    files += sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    return [f for f in files if os.path.isfile(f)]


def corpus(root: str = ROOT) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) token ids (int64): each file's first 90 % of bytes then ``<|eos|>``
    into train, its last 10 % then ``<|eos|>`` into validation."""
    train, val = [], []
    for path in corpus_files(root):
        with open(path, "rb") as f:
            data = np.frombuffer(f.read(), dtype=np.uint8).astype(np.int64)
        cut = int(len(data) * (1 - VALIDATION))
        train += [data[:cut], [EOS]]
        val += [data[cut:], [EOS]]
    return np.concatenate(train).astype(np.int64), np.concatenate(val).astype(np.int64)


CORPUS_FILE = "corpus.npz"


def saved_corpus(checkpoint: str) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) as `train` saved them beside the checkpoint (the repository's files
    change after training: the splits measured must be the ones it trained and held out)."""
    with np.load(os.path.join(checkpoint, CORPUS_FILE)) as f:
        return f["train"].astype(np.int64), f["validation"].astype(np.int64)


def encode(text: str) -> np.ndarray:
    """Token ids of `text` (its UTF-8 bytes)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def decode(ids) -> str:
    """Text of token ids (specials dropped; invalid UTF-8 replaced)."""
    return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def model_config():
    """The transformers config: checkpoints' tiny qwen3_5 with `SIZES` and the byte vocabulary."""
    import transformers

    from deltarule.tools.bench import checkpoints
    base = checkpoints.config("qwen3_5", "tiny", vocab_size=VOCAB).to_dict()
    for key in ("architectures", "transformers_version", "model_type"):
        base.pop(key, None)
    base.update(SIZES, vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    config = transformers.Qwen3_5TextConfig(**base)
    config.architectures = ["Qwen3_5ForCausalLM"]
    return config


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the `tokenizers` ByteLevel pre-tokenizer uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_tokenizer(directory: str) -> None:
    """A byte-level tokenizer (ids = bytes, `SPECIALS` after) as ``tokenizer.json`` and
    ``tokenizer_config.json`` in `directory`; checked against `encode` on a sample."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    chars = _bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(VOCAB - 256 - len(SPECIALS))]
    tokenizer.add_special_tokens(list(SPECIALS) + reserved)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=SPECIALS[0], bos_token=SPECIALS[1],
                                   eos_token=SPECIALS[2], model_max_length=SIZES["max_position_embeddings"])
    fast.save_pretrained(directory)
    loaded = AutoTokenizer.from_pretrained(directory)
    sample = "Gated delta rule — ∆ état\n\t<|eos|>"
    ids = loaded(sample, add_special_tokens=False)["input_ids"]
    want = list(encode(sample[:-len("<|eos|>")])) + [EOS]
    if ids != want or loaded.convert_tokens_to_ids(list(SPECIALS)) != [PAD, BOS, EOS] or len(loaded) != VOCAB:
        raise RuntimeError(f"byte-level tokenizer: {ids} != {want} or specials / size wrong ({len(loaded)})")


def _lr(step: int, progress: float, peak: float, warmup: int = 20) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def evaluate(model, tokens: np.ndarray, seq: int, batch: int = 16, windows: int | None = None) -> float:
    """Mean next-token loss (nats) of `model` over non-overlapping windows of `seq + 1` tokens
    of `tokens`: all of them, or `windows` of them evenly spread."""
    import torch
    starts = np.arange((len(tokens) - 1) // seq) * seq
    if windows is not None and windows < len(starts):
        starts = starts[np.linspace(0, len(starts) - 1, windows).round().astype(int)]
    n = len(starts)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, n, batch):
            x = torch.from_numpy(np.stack([tokens[s:s + seq + 1] for s in starts[i:i + batch]]))
            logits = model(input_ids=x[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                     reduction="sum")
            total, count = total + float(loss), count + x[:, 1:].numel()
    model.train()
    return total / count


def train(out: str = DEFAULT_OUT, *, budget: float = 240.0, steps: int | None = None, seq: int = 256,
          batch: int = 8, lr: float = 3e-3, seed: int = 0, threads: int | None = None,
          log_every: int = 25) -> dict:
    """Train (module docstring) and save to `out`; returns what ``training.json`` holds."""
    import torch
    import transformers

    from deltarule.integrations import transformers as integration

    if threads:
        torch.set_num_threads(threads)
    enabled = integration.enable()
    bound = [f"{b.module}.{b.attribute} ({b.kernel})" for b in enabled.bound if b.family == "qwen3_5"]
    if not bound:
        raise RuntimeError(f"deltarule did not bind transformers' qwen3_5 layers (left: {enabled.left.get('qwen3_5')})")
    print("deltarule bound: " + "; ".join(bound), flush=True)

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    train_tokens, val_tokens = corpus()
    config = model_config()
    model = transformers.Qwen3_5ForCausalLM(config).float().train()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f} M parameters; corpus {len(train_tokens)} train / {len(val_tokens)} "
          f"validation tokens (bytes); {torch.get_num_threads()} threads", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95))
    losses, step, start = [], 0, time.perf_counter()
    while True:
        elapsed = time.perf_counter() - start
        progress = step / steps if steps else elapsed / budget
        if progress >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, progress, lr)
        starts = rng.integers(0, len(train_tokens) - seq - 1, batch)
        x = torch.from_numpy(np.stack([train_tokens[s:s + seq + 1] for s in starts]))
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        if step % log_every == 0:
            print(f"step {step:5d}  {time.perf_counter() - start:6.1f} s  lr {optimizer.param_groups[0]['lr']:.2e}  "
                  f"loss {np.mean(losses[-log_every:]):.3f}", flush=True)
    seconds = time.perf_counter() - start
    train_loss = evaluate(model, train_tokens, seq, windows=32)
    val_loss = evaluate(model, val_tokens, seq)
    model.save_pretrained(out)
    write_tokenizer(out)
    np.savez_compressed(os.path.join(out, CORPUS_FILE), train=train_tokens.astype(np.uint16),
                        validation=val_tokens.astype(np.uint16))
    integration.disable()
    record = dict(parameters=params, steps=step, seconds=round(seconds, 1), batch=batch, seq=seq, lr=lr, seed=seed,
                  threads=torch.get_num_threads(), tokens_seen=step * batch * seq,
                  train_tokens=int(len(train_tokens)), validation_tokens=int(len(val_tokens)),
                  last_steps_loss=float(np.mean(losses[-log_every:])), train_loss=train_loss,
                  validation_loss=val_loss, machine=f"{platform.machine()}, {os.cpu_count()} cores",
                  files=[os.path.relpath(f, ROOT) for f in corpus_files()], bound=bound)
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(record, f, indent=2)
    print(f"trained {step} steps in {seconds:.0f} s ({record['tokens_seen']} tokens): train loss {train_loss:.3f} "
          f"nats/byte (32 windows of {seq}), validation loss {val_loss:.3f} (perplexity {math.exp(val_loss):.2f}, "
          f"{val_loss / math.log(2):.3f} bits/byte, {len(val_tokens)} tokens); saved to {out}", flush=True)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--budget", type=float, default=240.0, help="training seconds (wall clock; default 240)")
    parser.add_argument("--steps", type=int, help="train this many steps instead of --budget (deterministic)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--overwrite", action="store_true", help="retrain over an existing checkpoint")
    args = parser.parse_args(argv)
    if os.path.isfile(os.path.join(args.out, "config.json")) and not args.overwrite:
        print(f"{args.out} holds a checkpoint (--overwrite to retrain)")
        return 0
    train(args.out, budget=args.budget, steps=args.steps, seq=args.seq, batch=args.batch, lr=args.lr, seed=args.seed,
          threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
