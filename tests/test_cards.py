"""The WebGPU kernel cards (`deltarule card export`): files, digests, contracts, and expected
outputs checked against deltarule's own backends. The cards run in Dawn and Chromium from
web/ (`bash .ci/web test`); this checks what Python writes."""

import hashlib
import inspect
import json
import os

import numpy as np
import pytest
import torch

import deltarule
from deltarule import cards
from deltarule.tools import check
from deltarule.cards import fixtures, manifests
from deltarule.tools.cli import main as cli
from deltarule.contracts import ort
from deltarule.problem import capture_parts


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("cards")
    assert cli(["card", "export", str(root)]) == 0
    return root


def _load(folder, name):
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


@pytest.mark.parametrize("card_id", list(cards.CARDS))
def test_card_files_and_digests(exported, card_id):
    folder = exported / card_id
    metadata = _load(folder, "metadata.json")
    assert metadata["id"] == card_id
    names = set(os.listdir(folder)) - {"metadata.json"}
    assert set(metadata["digests"]) == names
    for name, digest in metadata["digests"].items():
        assert digest == "sha256:" + hashlib.sha256((folder / name).read_bytes()).hexdigest(), name
    assert {t for v in metadata["variants"] for t in v["templates"]} <= set(metadata["templates"]) <= names
    assert _load(folder, "manifest.json")["id"] == card_id
    assert _load(folder, "test.json")["cases"] and _load(folder, "bench.json")["cases"]


def test_export_is_deterministic(exported, tmp_path):
    cards.export(str(tmp_path), ["com.microsoft.LinearAttentionGate"])
    card = "com.microsoft.LinearAttentionGate"
    for name in os.listdir(exported / card):
        assert (tmp_path / card / name).read_bytes() == (exported / card / name).read_bytes(), name


def test_gated_delta_net_manifest_is_the_adapters_contract():
    """Attribute names and defaults are those of deltarule.contracts.ort.gated_delta_net
    (which follows ONNX Runtime), inputs in the operator's order."""
    signature = inspect.signature(ort.gated_delta_net).parameters
    for a in manifests.GATED_DELTA_NET["attributes"]:
        assert signature[a["name"]].default == a["default"], a["name"]
    positional = [n for n, p in signature.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [x["name"] for x in manifests.GATED_DELTA_NET["inputs"]] == positional
    assert [x["bind"] for x in manifests.GATED_DELTA_NET["inputs"]] == list(fixtures.GDN_INPUTS)


def _ort_schema(name: str):
    onnxruntime = pytest.importorskip("onnxruntime")
    schemas = onnxruntime.capi.onnxruntime_pybind11_state.get_all_operator_schema()
    return next(s for s in schemas if s.name == name and s.domain == "com.microsoft")


def test_gated_delta_net_manifest_is_onnxruntimes_schema():
    """Inputs and outputs in ONNX Runtime's order with its names, attributes with its names and
    defaults (the installed onnxruntime's contrib schema), state_update_capacity's range [0, 8]."""
    import onnx

    schema = _ort_schema("GatedDeltaNet")
    manifest = manifests.GATED_DELTA_NET
    assert [x["name"] for x in manifest["inputs"]] == [i.name for i in schema.inputs]
    assert [x["name"] for x in manifest["outputs"]] == [o.name for o in schema.outputs]
    attributes = {a["name"]: a for a in manifest["attributes"]}
    assert set(attributes) == set(schema.attributes)
    for name, attr in schema.attributes.items():
        default = onnx.helper.get_attribute_value(onnx.AttributeProto.FromString(attr._default_value))
        default = default.decode() if isinstance(default, bytes) else default
        assert attributes[name]["default"] == pytest.approx(default), name
    assert attributes["state_update_capacity"]["values"] == list(range(9))
    assert "[0, 8]" in schema.attributes["state_update_capacity"].description
    assert set(attributes["gate_activation"]["values"]) == {"none", "softplus", "qwen", "sigmoid", "kda"}


def _inputs(case):
    return {bind: torch.from_numpy(fixtures.decode(t).copy()) for bind, t in case["inputs"].items()}


def _wide(t: dict) -> np.ndarray:
    x = fixtures.decode(t)
    if t["dtype"] == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def _rel(out, expected: dict) -> float:
    return check.rel_err(out if isinstance(out, torch.Tensor) else torch.from_numpy(out), _wide(expected))


@pytest.fixture(scope="module")
def gdn_cases():
    return fixtures.gated_delta_net_tests()


def test_gated_delta_net_expected_outputs_match_the_cpu_backend(gdn_cases):
    """Each case's expected outputs (state_update included) against the ORT adapter on deltarule's
    default backend: the card's expected values and inputs are what the contract says they are."""
    for case in gdn_cases:
        x = _inputs(case)
        outputs = ort.gated_delta_net(*(x.get(n) for n in fixtures.GDN_INPUTS), **case["attributes"])
        assert len(outputs) == len(case["expected"]), case["name"]
        for bind, out in zip(("outputT", "finalStateT", "stateUpdateT"), outputs):
            assert _rel(out, case["expected"][bind]) <= case["tolerance"][bind], (case["name"], bind)


def _card_capture(case, backend):
    """A capture case's state_update on `backend`: the ORT adapter's mapping (its zero `capture`
    buffer when active), linear_attention on `backend`, then zeros past the clamped counts."""
    x = _inputs(case)
    _, args, _ = ort.gated_delta_net_arguments(*(x.get(n) for n in fixtures.GDN_INPUTS), **case["attributes"])
    out = torch.zeros(case["expected"]["stateUpdateT"]["shape"])
    if "capture" not in args:                       # state_update_active = 0: nothing captured
        return out
    args.pop("accept_growth")
    deltarule.linear_attention(**args, backend=backend)
    p = deltarule.validate(**args)
    counts = [min(max(c, 0), p.capacity, s.length) for c, s in zip(x["captureCountT"].tolist(), p.spans)]
    for part, got in zip(capture_parts(out, p.capacity, p.decay_width, p.Hk, p.K, p.Hv, p.V), p.capture_parts()):
        for n, c in enumerate(counts):
            part[n, :c] = got[n, :c]
    return out


def test_gated_delta_net_state_update_matches_the_wgsl_capture(gdn_cases):
    """Each capture case's expected state_update against the wgsl backend's compact capture (the
    card's shader, Python's host): per-key decay, kda, clamped counts, an inactive capture."""
    from deltarule.kernels.wgsl import _device

    if _device.unavailable_reason():
        pytest.skip(f"no WebGPU device: {_device.unavailable_reason()}")
    captured = [c for c in gdn_cases if "stateUpdateT" in c["expected"]]
    assert len(captured) >= 8
    for case in captured:
        got = _card_capture(case, "wgsl")
        assert _rel(got, case["expected"]["stateUpdateT"]) <= case["tolerance"]["stateUpdateT"], case["name"]
    inactive = next(c for c in captured if c["name"].startswith("capture-inactive"))
    assert not fixtures.decode(inactive["expected"]["stateUpdateT"]).any()


def test_gated_delta_net_cases_cover_ort_132s_additions(gdn_cases):
    """Per-key decay (both dt_bias spellings, a per-head bias broadcast), the sigmoid / kda gate
    with a bound other than the default, float16, the chunked prefill (S >= 128) and capture
    counts below, at and above C, negative and over an empty request."""
    by_name = {c["name"]: c for c in gdn_cases}
    per_key = [c for c in gdn_cases if len(c["inputs"].get("decayT", {"shape": []})["shape"])
               == len(c["inputs"]["queryT"]["shape"])]
    assert {tuple(c["inputs"]["dtBiasT"]["shape"]) for c in per_key if "dtBiasT" in c["inputs"]} >= {(2, 12), (32,),
                                                                                                     (4,)}
    assert {c["attributes"]["gate_activation"] for c in per_key} >= {"none", "softplus", "sigmoid", "kda"}
    assert any(c["attributes"]["gate_lower_bound"] != -5.0 for c in per_key)
    assert any(c["inputs"]["queryT"]["shape"][1] >= 128 for c in per_key if len(c["inputs"]["queryT"]["shape"]) == 4)
    counts = by_name["capture-C3-T16-cu-empty-counts-clamped"]["inputs"]["captureCountT"]
    assert fixtures.decode(counts).tolist() == [2, 3, 9, 9, -1]


def test_gate_expected_outputs_match_deltarule_gate():
    for case in fixtures.linear_attention_gate_tests():
        x = _inputs(case)
        decay, beta = ort.linear_attention_gate(x["aT"], x["dtBiasT"], x["decayScaleT"], x.get("bT"))
        assert _rel(decay, case["expected"]["decayT"]) <= case["tolerance"]["decayT"], case["name"]
        if "betaT" in case["expected"]:
            assert _rel(beta, case["expected"]["betaT"]) <= case["tolerance"]["betaT"], case["name"]


def test_linear_attention_cases_come_from_test_json():
    """Every float32-state case of deltarule's test.json within the size caps, each dtype it
    lists; the strong-decay long sequences included."""
    names = {c["name"] for c in fixtures.linear_attention_tests()}
    assert {"varlen-T90-empty", "spec-B3-L4-accepted-gva", "slab-B3-T20-indices",
            "gdn2-B2-T65-H4-K32-gk-erase-write", "gdn2-B2-T65-H4-K32-gk-erase-write-bfloat16",
            "strong-B1-T2048-H2-K32-g", "reset-B1-T100-g-minus-inf"} <= names
    assert not any("state-bf16" in n or "slab-bf16" in n for n in names)      # float32 states only
    assert not any(n.startswith("capture-") for n in names)                   # the card has no capture


def test_tensor_roundtrip_and_16_bit_bits():
    x = torch.tensor([1.0, -2.5, 65504.0], dtype=torch.float16)
    t = fixtures.tensor(x)
    assert t["dtype"] == "float16" and fixtures.decode(t).tolist() == [1.0, -2.5, 65504.0]
    b = fixtures.tensor(torch.tensor([1.0, -3.0]), torch.bfloat16)
    assert fixtures.decode(b).tolist() == [0x3F80, 0xC040]


def test_cli_rejects_an_unknown_card(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli(["card", "export", str(tmp_path), "--only", "com.example.Nope"])
    assert e.value.code == 2 and "com.example.Nope" in capsys.readouterr().err
