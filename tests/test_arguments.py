"""The one record of a call (`deltarule.arguments`): what is derived from it agrees with it,
and what is written out against it (the public signatures, the positional call of the eager
engine) is refused when it drifts."""

import ast
import inspect
import pathlib

import pytest
import torch

import deltarule
from deltarule import api, arguments, custom_ops, distributed, eager, validation
from deltarule.tools import eager_source

ROOT = pathlib.Path(__file__).resolve().parents[1] / "deltarule"


def test_public_functions_take_the_records_arguments():
    """check_signature ran at import; here it is shown to refuse a drift: two arguments
    swapped, a default changed, one missing (against the record's first five)."""
    arguments.check_signature(api.linear_attention)
    arguments.check_signature(api.call, internal=True)
    arguments.check_signature(validation.validate, without=("backend",), internal=True)

    def swapped(q, k, v, *, rule="gated_delta", gk=None, g=None):
        pass

    def default(q, k, v, *, rule="gated", g=None):
        pass

    def missing(q, k, v, *, g=None):
        pass

    for fn, match in ((swapped, "arguments"), (default, "rule: 'gated'"), (missing, "arguments")):
        with pytest.raises(TypeError, match=match):
            arguments.check_signature(fn, without=arguments.NAMES[5:])
    sig = inspect.signature(api.linear_attention)
    assert list(sig.parameters) == [a.name for a in arguments.ARGUMENTS if a.public]


def _eager_calls(path: pathlib.Path):
    """Every `eager.run(...)` call in a module: its argument expressions."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "run" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "eager":
            yield node


def test_the_positional_calls_of_the_eager_path_follow_the_record():
    """`eager.run` takes the record's arguments positionally (for speed: deltarule.eager);
    every call of it in the package passes them by the record's names, in its order (the
    last one, accept_growth, may be a constant), so a misorder fails here."""
    found = 0
    for path in ROOT.rglob("*.py"):
        for node in _eager_calls(path):
            found += 1
            assert not node.keywords, f"{path.name}:{node.lineno}"
            names = [a.id if isinstance(a, ast.Name) else None for a in node.args]
            assert names[:-1] == list(arguments.NAMES[:-1]), f"{path.name}:{node.lineno}: {names}"
            assert names[-1] == "accept_growth" or isinstance(node.args[-1], ast.Constant), f"{path.name}:{node.lineno}"
    assert found == 2                          # api.linear_attention and api.call
    assert list(inspect.signature(eager.run).parameters) == list(arguments.NAMES)


def test_the_eager_path_is_what_its_generator_writes():
    """deltarule/eager.py is checked in, generated from the record: an argument added to the
    record, or a hand edit, fails here until `python -m deltarule.tools.eager_source` rewrites it."""
    assert eager_source.PATH.read_text() == eager_source.source(), \
        "deltarule/eager.py differs from its generator: run python -m deltarule.tools.eager_source"
    assert eager_source.main(["--check"]) == 0


def test_op_schemas_are_the_records():
    schema = torch.ops.deltarule.linear_attention.default._schema
    names = [a.name for a in schema.arguments]
    assert names == [*arguments.op_names(), "num_states"]
    slab = torch.ops.deltarule.linear_attention_slab.default._schema
    assert [a.name for a in slab.arguments] == list(arguments.op_names())
    assert [a.name for a in slab.arguments if a.alias_info is not None and a.alias_info.is_write] == ["initial_state"]
    backward = torch.ops.deltarule.linear_attention_backward.default._schema
    assert [a.name for a in backward.arguments] == ["do", "dstate", *arguments.op_names()]
    assert custom_ops._DIFFERENTIABLE == tuple(names.index(n) for n in arguments.OPERANDS)


def test_ops_exist_when_deltarule_is_imported():
    """In a fresh interpreter, `import deltarule` alone registers the ops (torch.export and
    AOT users name them before anything is traced)."""
    import subprocess
    import sys
    code = "import torch, deltarule; print(hasattr(torch.ops.deltarule, 'linear_attention_slab'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_distributed_takes_the_records_arguments_but_the_serving_ones():
    arguments.check_signature(distributed.linear_attention,
                              without=("seq_lens", "state_indices", "num_accepted_tokens", "plan", "capture"),
                              extra=("group",))
    assert deltarule.linear_attention is api.linear_attention
