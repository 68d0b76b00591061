"""The examples in the docstrings and the README run."""

import doctest
import pathlib
import re

import deltarule.api

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_api_docstring_example_runs():
    result = doctest.testmod(deltarule.api)
    assert result.attempted > 0 and result.failed == 0


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
