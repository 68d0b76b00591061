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

from deltarule import cards, check
from deltarule.cards import cases, manifests
from deltarule.cli import main as cli
from deltarule.contracts import ort


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


def _inputs(case):
    return {bind: torch.from_numpy(cases.decode(t).copy()) for bind, t in case["inputs"].items()}


def _wide(t: dict) -> np.ndarray:
    x = cases.decode(t)
    if t["dtype"] == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def _rel(out, expected: dict) -> float:
    return check.rel_err(out if isinstance(out, torch.Tensor) else torch.from_numpy(out), _wide(expected))


def test_gated_delta_net_expected_outputs_match_the_cpu_backend():
    """Each case's expected output against the ORT adapter on deltarule's default backend: the
    card's expected values and inputs are what the contract says they are."""
    for case in cases.gated_delta_net_tests():
        x = _inputs(case)
        names = ("queryT", "keyT", "valueT", "cuSeqlensT", "decayT", "betaT", "initialStateT", "aLogT", "dtBiasT")
        o, s = ort.gated_delta_net(*(x.get(n) for n in names), **case["attributes"])
        tol = case["tolerance"]["outputT"]
        assert _rel(o, case["expected"]["outputT"]) <= tol, case["name"]
        assert _rel(s, case["expected"]["finalStateT"]) <= tol, case["name"]


def test_gate_expected_outputs_match_deltarule_gate():
    for case in cases.linear_attention_gate_tests():
        x = _inputs(case)
        decay, beta = ort.linear_attention_gate(x["aT"], x["dtBiasT"], x["decayScaleT"], x.get("bT"))
        assert _rel(decay, case["expected"]["decayT"]) <= case["tolerance"]["decayT"], case["name"]
        if "betaT" in case["expected"]:
            assert _rel(beta, case["expected"]["betaT"]) <= case["tolerance"]["betaT"], case["name"]


def test_linear_attention_cases_come_from_test_json():
    """Every float32-state case of deltarule's test.json within the size caps, each dtype it
    lists; the strong-decay long sequences included."""
    names = {c["name"] for c in cases.linear_attention_tests()}
    assert {"varlen-T90-empty", "spec-B3-L4-accepted-gva", "slab-B3-T20-indices",
            "gdn2-B2-T65-H4-K32-gk-erase-write", "gdn2-B2-T65-H4-K32-gk-erase-write-bfloat16",
            "strong-B1-T2048-H2-K32-g", "reset-B1-T100-g-minus-inf"} <= names
    assert not any("state-bf16" in n or "slab-bf16" in n for n in names)      # float32 states only


def test_tensor_roundtrip_and_16_bit_bits():
    x = torch.tensor([1.0, -2.5, 65504.0], dtype=torch.float16)
    t = cases.tensor(x)
    assert t["dtype"] == "float16" and cases.decode(t).tolist() == [1.0, -2.5, 65504.0]
    b = cases.tensor(torch.tensor([1.0, -3.0]), torch.bfloat16)
    assert cases.decode(b).tolist() == [0x3F80, 0xC040]


def test_cli_rejects_an_unknown_card(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli(["card", "export", str(tmp_path), "--only", "com.example.Nope"])
    assert e.value.code == 2 and "com.example.Nope" in capsys.readouterr().err
