"""`deltarule.onnx.export.export_model` refuses what it cannot do right before it works, and writes its folder
whole or not at all: bad arguments and paths before the checkpoint loads, weights that do not
fit the model before anything is written, a killed export leaves no model, `overwrite` clears
what an earlier export wrote (and only that)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

import deltarule  # noqa: E402
import deltarule.onnx.export  # noqa: E402
from deltarule.tools.bench import checkpoints  # noqa: E402
from deltarule.onnx.export import exporter  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoints.save("qwen3_5", str(tmp_path_factory.mktemp("qwen3_5")))


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if the export gets as far as loading the checkpoint."""
    def load(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the arguments were checked")
    monkeypatch.setattr(exporter, "load", load)


def _copy(checkpoint: str, directory, *, config=None, weights=None) -> str:
    """A copy of `checkpoint` in `directory`: its config.json replaced by `config` (text) and its
    weights by `weights` (name -> tensor) where given."""
    os.makedirs(directory)
    with open(os.path.join(checkpoint, "config.json")) as f:
        text = f.read()
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write(text if config is None else config)
    tensors = safetensors.load_file(os.path.join(checkpoint, "model.safetensors")) if weights is None else weights
    safetensors.save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


def _refused(error, argument_or_text: str, model_dir, out_dir, **kwargs):
    with pytest.raises(error) as info:
        deltarule.onnx.export.export_model(model_dir, out_dir, **kwargs)
    if error is deltarule.ContractError:
        assert info.value.argument == argument_or_text, str(info.value)
    else:
        assert argument_or_text in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(target=["ort"]), "target"), (dict(target="tflite"), "target"), (dict(target=None), "target"),
    (dict(dtype="int8"), "dtype"), (dict(dtype=torch.float16), "dtype"), (dict(overwrite="yes"), "overwrite"),
], ids=["target-list", "target-unknown", "target-none", "dtype-unknown", "dtype-torch", "overwrite-str"])
def test_bad_arguments_are_refused_before_loading(tmp_path, checkpoint, no_loading, kwargs, argument):
    _refused(deltarule.ContractError, argument, checkpoint, str(tmp_path / "out"), **kwargs)
    assert os.listdir(tmp_path) == []


def test_bad_checkpoint_folders_are_refused_before_loading(tmp_path, checkpoint, no_loading):
    out = str(tmp_path / "out")
    for model_dir in (None, 3, str(tmp_path / "missing"), os.path.join(checkpoint, "config.json")):
        _refused(deltarule.ContractError, "model_dir", model_dir, out)
    for name, config in (("corrupt", '{"model_type": "qwen3_5_text",'), ("list", "[1, 2]"), ("binary", "\udcff")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(config, errors="surrogateescape")
        (folder / "model.safetensors").write_bytes(b"")
        assert "config.json" in _refused(deltarule.ContractError, "model_dir", str(folder), out)
    bare = tmp_path / "no-weights"
    bare.mkdir()
    (bare / "config.json").write_text(open(os.path.join(checkpoint, "config.json")).read())
    assert "model.safetensors" in _refused(deltarule.ContractError, "model_dir", str(bare), out)
    assert not os.path.exists(out)


def test_bad_out_dirs_are_refused_before_loading(tmp_path, checkpoint, no_loading):
    afile = tmp_path / "file"
    afile.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    for out_dir, why in ((checkpoint, "other than the checkpoint"), (os.path.join(checkpoint, "out"), "inside"),
                         (os.path.dirname(checkpoint), "around"), (str(afile), "file"),
                         (str(afile / "sub"), "file"), ("", "empty"), (None, "NoneType"),
                         (str(full), "notes.txt")):
        assert why in _refused(deltarule.ContractError, "out_dir", checkpoint, out_dir)
    assert sorted(os.listdir(checkpoint)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert os.listdir(full) == ["notes.txt"]


def test_models_transformers_cannot_run_are_unsupported_before_loading(tmp_path, checkpoint, no_loading):
    config = json.loads(open(os.path.join(checkpoint, "config.json")).read())
    linear_only = dict(config, layer_types=["linear_attention"] * config["num_hidden_layers"])
    unknown = dict(config, model_type="qwen9_hybrid")
    for name, cfg, text in (("linear-only", linear_only, "every layer"), ("unknown", unknown, "qwen9_hybrid")):
        folder = _copy(checkpoint, tmp_path / name, config=json.dumps(cfg))
        _refused(deltarule.Unsupported, text, folder, str(tmp_path / "out"))


def test_configs_and_weight_files_transformers_cannot_read_are_refused(tmp_path, checkpoint):
    """A config.json transformers' validators refuse (layer_types of another length) and a weights
    file that does not parse: ContractError on model_dir, one line, nothing written."""
    config = json.loads(open(os.path.join(checkpoint, "config.json")).read())
    short = _copy(checkpoint, tmp_path / "short", config=json.dumps(dict(config, layer_types=["linear_attention"])))
    assert "layer_types" in _refused(deltarule.ContractError, "model_dir", short, str(tmp_path / "out"))
    garbage = _copy(checkpoint, tmp_path / "garbage")
    with open(os.path.join(garbage, "model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 8)                       # the header length: far past the file
    assert "SafetensorError" in _refused(deltarule.ContractError, "model_dir", garbage, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["garbage", "short"]


def test_weights_that_do_not_fit_the_model_are_refused_by_name(tmp_path, checkpoint):
    """transformers fills missing weights randomly and would export them; every missing,
    unexpected and mismatched tensor is named instead, and nothing is written."""
    weights = safetensors.load_file(os.path.join(checkpoint, "model.safetensors"))
    projection = next(name for name in weights if name.endswith("linear_attn.in_proj_qkv.weight"))
    missing = {k: v for k, v in weights.items() if k not in ("lm_head.weight", projection)}
    extra = dict(weights, **{"model.extra.weight": torch.zeros(3)})
    embed = weights["model.embed_tokens.weight"]
    wider = dict(weights, **{"model.embed_tokens.weight": torch.zeros(embed.shape[0] + 8, embed.shape[1])})
    out = tmp_path / "out"
    for name, tensors, named in (("missing", missing, ("missing", "lm_head.weight", projection)),
                                 ("unexpected", extra, ("unexpected", "model.extra.weight")),
                                 ("vocab", wider, ("mismatched", "model.embed_tokens.weight",
                                                   f"checkpoint [{embed.shape[0] + 8}, {embed.shape[1]}]"))):
        message = _refused(deltarule.ContractError, "model_dir", _copy(checkpoint, tmp_path / name, weights=tensors),
                           str(out))
        assert all(text in message for text in named), message
    assert sorted(os.listdir(tmp_path)) == ["missing", "unexpected", "vocab"]


def test_a_failing_export_leaves_nothing(tmp_path, checkpoint, monkeypatch):
    """An error after the model files are written (here: writing genai_config.json) leaves
    neither `out_dir` nor the staging folder."""
    def fail(*args, **kwargs):
        raise RuntimeError("disk full")
    monkeypatch.setattr(exporter, "_write_genai_config", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        deltarule.onnx.export.export_model(checkpoint, str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


_KILLED = """
import os, signal, sys
from deltarule.onnx.export import exporter
def killed(config, layout, out_dir, *, filename):
    assert os.path.isfile(os.path.join(out_dir, "onnx", "model.onnx"))      # the model is written
    os.kill(os.getpid(), signal.SIGKILL)
exporter._write_genai_config = killed
exporter.export_model(sys.argv[1], sys.argv[2])
"""


def test_a_killed_export_leaves_no_model_in_out_dir(tmp_path, checkpoint):
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLED), checkpoint, str(out)], capture_output=True)
    assert run.returncode == -signal.SIGKILL, run.stderr.decode()[-2000:]
    assert not out.exists()
    left = os.listdir(tmp_path)             # the hidden staging folder, named as such
    assert len(left) == 1 and left[0].startswith(".out.") and left[0].endswith(".partial"), left


def test_overwrite_clears_what_an_export_wrote_and_keeps_the_rest(tmp_path, checkpoint):
    """An OLMo-Hybrid export over a Qwen3.5 one: refused without overwrite; with it, the old
    genai_config.json and tokenizer files are gone (OLMo-Hybrid writes no genai config and its
    checkpoint has no tokenizer here), a file of the user's stays."""
    out = tmp_path / "out"
    first = deltarule.onnx.export.export_model(checkpoint, str(out))
    assert first.no_genai_config is None and (out / "genai_config.json").is_file()
    (out / "tokenizer.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    olmo = checkpoints.save("olmo_hybrid", str(tmp_path / "olmo"))
    _refused(deltarule.ContractError, "out_dir", olmo, str(out))
    second = deltarule.onnx.export.export_model(olmo, str(out), overwrite=True)
    assert second.no_genai_config is not None
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "notes.txt", "onnx"]
    assert json.loads((out / "config.json").read_text())["model_type"] == "olmo_hybrid"
    assert sorted(os.listdir(out / "onnx")) == ["model.onnx"]
    assert [p for p in os.listdir(tmp_path) if p.endswith(".partial")] == []


def test_command_line_overwrite(tmp_path, checkpoint, capfd):
    from deltarule.tools.cli import main
    weights = safetensors.load_file(os.path.join(checkpoint, "model.safetensors"))
    missing = _copy(checkpoint, tmp_path / "missing", weights={k: v for k, v in weights.items() if k != "lm_head.weight"})
    assert main(["export", "onnx", missing, str(tmp_path / "x")]) == 2
    err = capfd.readouterr().err                    # no load report, progress bar or warning before it
    assert err.count("\n") == 1 and "missing lm_head.weight" in err, err
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["export", "onnx", checkpoint, str(out)]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "out_dir: expected a new or empty folder" in err
    assert main(["export", "onnx", checkpoint, str(out), "--overwrite"]) == 0
    assert (out / "onnx" / "model.onnx").is_file() and (out / "notes.txt").is_file()
