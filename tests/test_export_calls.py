"""`deltarule.export.to_onnx` on single `linear_attention` calls: every argument of the call
record the translation accepts (gate forms, g with gk, the raw-gate arm, the sigmoid on every
gate, scales including 0, L2 norm, state layouts and dtypes, GQA / GVA, 16-bit operands beside
float32 gates) gives the eager call's result in ONNX Runtime and in `deltarule.onnx.run`; the
rest is refused at export time, naming the argument."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from hypothesis import HealthCheck, given, settings

pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

import deltarule  # noqa: E402
from deltarule.check import STORE_TOL  # noqa: E402
from deltarule.export.exporter import to_onnx  # noqa: E402
from deltarule.onnx import run  # noqa: E402

from strategies import Call, make_args, valid_calls  # noqa: E402

# ONNX's node and deltarule's kernel both compute in float32, then round to the output's
# dtype: they differ by float32 arithmetic order and at most one rounding of the stored value
ARITHMETIC_TOL = 1e-5
_ONNX_TYPES = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
               torch.bfloat16: onnx.TensorProto.BFLOAT16}
CALLS = valid_calls(max_B=2, max_T=4, max_dim=6, min_B=1, min_T=1, layouts=("dense",), slabs=("none",),
                    views=False, plans=False)


class _Call(torch.nn.Module):
    """One `linear_attention` call: takes its tensors in float32 (what ONNX Runtime is fed) and
    casts each to the call's dtype inside, so 16-bit operands and states are part of the graph."""

    def __init__(self, args: dict):
        super().__init__()
        self.names = [n for n, x in args.items() if isinstance(x, torch.Tensor)]
        self.dtypes = [args[n].dtype for n in self.names]
        self.scalars = {n: x for n, x in args.items() if not isinstance(x, torch.Tensor)}

    def forward(self, *tensors):
        tensors = {n: x.to(dtype) for n, x, dtype in zip(self.names, tensors, self.dtypes)}
        return deltarule.linear_attention(**tensors, **self.scalars)


def _exported(args: dict, target: str):
    module = _Call(args)
    inputs = tuple(args[n].float() for n in module.names)
    program = torch.export.export(module, inputs, strict=False)
    model = to_onnx(program, target, inputs=module.names, outputs=["o", "state"], roles={})
    return module, inputs, model


def _assert_equal_to_eager(name: str, got: np.ndarray, want: torch.Tensor) -> None:
    """`got` has the eager result's dtype (bfloat16 read as float32), shape, non-finite elements, and values within float32
    arithmetic plus one rounding to the dtype."""
    want_np = want.float().numpy() if want.dtype == torch.bfloat16 else want.numpy()     # (exact)
    assert got.dtype == want_np.dtype and got.shape == want_np.shape, (name, got.dtype, got.shape)
    finite = np.isfinite(want_np)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f"{name}: non-finite elements differ")
    want64, got64 = want_np[finite].astype(np.float64), got[finite].astype(np.float64)
    scale = np.linalg.norm(want64)
    error = np.linalg.norm(got64 - want64) / scale if scale else np.abs(got64).max(initial=0.0)
    assert error <= ARITHMETIC_TOL + STORE_TOL[want.dtype], f"{name}: relative error {error:.3e}"


def _readable(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with its bfloat16 outputs cast to float32 after the fact (NumPy has no bfloat16;
    the cast is exact)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for value in model.graph.output:
        if value.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16:
            stored = value.name + "_bfloat16"
            for node in model.graph.node:
                node.output[:] = [stored if x == value.name else x for x in node.output]
            model.graph.node.append(onnx.helper.make_node("Cast", [stored], [value.name], to=onnx.TensorProto.FLOAT))
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    return model


def _check(call: Call, target: str) -> None:
    args = make_args(call)
    module, inputs, model = _exported(args, target)
    want = module(*inputs)
    declared = [value.type.tensor_type.elem_type for value in model.graph.output]
    assert declared == [_ONNX_TYPES[w.dtype] for w in want], "the graph's outputs are not the eager dtypes"
    model = _readable(model)
    feeds = {n: x.numpy() for n, x in zip(module.names, inputs)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for runner, got in (("onnxruntime", session.run(None, feeds)), ("deltarule.onnx.run", run(model, feeds))):
        for name, g, w in zip(("o", "state"), got, want):
            _assert_equal_to_eager(f"{runner} {name}", g, w)


@pytest.mark.parametrize("target", ["ort", "onnx"])
@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(call=CALLS)
def test_every_accepted_call_exports_to_the_eager_result(target, call):
    _check(call, target)


@pytest.mark.parametrize("scale", [0.0, -0.0, 1e-46, -2.5, None])
def test_scales_zero_and_below_float32_are_not_the_nodes_default(scale):
    """ONNX reads scale 0 as 1 / sqrt(d_k); deltarule's 0 (and a scale float32 rounds to 0) is 0."""
    _check(Call(seed=3, B=2, T=3, Hq=2, Hk=2, Hv=2, K=4, V=4, scale=scale), "ort")


@pytest.mark.parametrize("target", ["ORT", "tensorrt", None, ["ort"]])
def test_an_unknown_target_is_refused_before_converting(target, monkeypatch):
    args = make_args(Call(seed=2, B=1, T=2, K=4, V=4))
    module = _Call(args)
    program = torch.export.export(module, tuple(args[n].float() for n in module.names), strict=False)

    def convert(*args, **kwargs):
        raise AssertionError("converted before the target was checked")
    monkeypatch.setattr(torch.onnx, "export", convert)
    with pytest.raises(deltarule.ContractError, match="^target: expected 'ort' | 'onnx'"):
        to_onnx(program, target, inputs=module.names, outputs=["o", "state"], roles={})


@pytest.mark.parametrize("index", ["cu_seqlens", "seq_lens"])
def test_calls_without_a_node_are_refused_naming_the_argument(index):
    args = make_args(Call(seed=1, B=1, T=4, K=4, V=4))
    args[index] = torch.tensor([0, 4], dtype=torch.int32) if index == "cu_seqlens" else torch.tensor([3])
    with pytest.raises(deltarule.Unsupported, match=rf"\({index}\)"):
        _exported(args, "ort")
