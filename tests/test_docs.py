"""The examples in the docstrings, the README and docs/design.md run."""

import doctest
import pathlib
import re
import sys

import pytest

import deltarule.api
import deltarule.batch
import deltarule.cards
import deltarule.contracts.ascend
import deltarule.contracts.fla
import deltarule.contracts.slab
import deltarule.conv.slab
import deltarule.conv.with_state
import deltarule.custom_ops
import deltarule.distributed
import deltarule.gate  # noqa: F401 - the module (deltarule.gate is the function `gate`)
import deltarule.integrations.drop_ins
import deltarule.integrations.hf_kernels
import deltarule.kernels.cpu.layout
import deltarule.kernels.cpu.recurrent
import deltarule.onnx.export.exporter
import deltarule.replay  # noqa: F401 - the module (deltarule.replay is the function `replay`)
import deltarule.tools.paths
import deltarule.tools.versions

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


@pytest.mark.parametrize("module", [deltarule.api, deltarule.batch, deltarule.cards, deltarule.contracts.ascend,
                                    deltarule.contracts.fla, deltarule.contracts.slab, deltarule.conv.slab,
                                    deltarule.conv.with_state, deltarule.distributed,
                                    deltarule.onnx.export.exporter, sys.modules["deltarule.gate"], deltarule.tools.paths,
                                    deltarule.integrations.drop_ins, deltarule.integrations.hf_kernels,
                                    deltarule.kernels.cpu.layout, deltarule.kernels.cpu.recurrent, deltarule.custom_ops,
                                    sys.modules["deltarule.replay"], deltarule.tools.versions],
                         ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_design_examples_run():
    """Every python block of docs/design.md that starts with an import is a runnable example."""
    text = (ROOT / "docs" / "design.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith("import ")]
    assert blocks
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/design.md example {i}", "exec"), {})


def test_readme_quickstart_runs(capsys):
    text = README.read_text()
    block = re.search(r"## Quickstart\n\n```python\n(.*?)```", text, re.S).group(1)
    exec(compile(block, "README quickstart", "exec"), {})
    assert "torch.Size([1, 128, 4, 64])" in capsys.readouterr().out


def test_gate_docstring_example_runs():
    import importlib
    module = importlib.import_module("deltarule.gate")   # the attribute deltarule.gate is the function
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
