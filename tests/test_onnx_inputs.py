"""Feeds and model files refused up front (issue 46, parts 4 and 5).

`deltarule.onnx.run` / `Session` check the feeds against the graph's declared inputs as ONNX
Runtime's `InferenceSession.run` does (a missing or unknown name, the element type, the rank,
every static dimension), before any sub-model session is built, with `ContractError` naming
the input; what ORT accepts (symbolic dimensions that differ, lists) stays accepted and gives
ORT's outputs. A truncated or unreadable model file is refused naming ``model``.

`deltarule.onnx.export.generate.DecoderSession` refuses, naming the argument and before its
session runs: token ids outside [0, vocab) (the vocabulary read from the embedding table,
else the logits' last dimension; a symbolic one refuses only negative ids), an empty or
non-2-D-integer prompt, fewer than one new token, a mask or past state that does not fit,
a truncated or missing model file (``path``, ``embed``), an unknown runner.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="deltarule.onnx needs the 'onnx' package")
ort = pytest.importorskip("onnxruntime", reason="these checks compare with onnxruntime")

from hypothesis import HealthCheck, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from deltarule import ContractError  # noqa: E402
from deltarule import onnx as donnx  # noqa: E402
from deltarule.tools.bench import onnx_block as bench  # noqa: E402
from deltarule.onnx.feeds import Inputs  # noqa: E402

EXAMPLES = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# ---------------------------------------------------------------------------
# a few-node model with inputs of several element types, ranks and static dimensions
# ---------------------------------------------------------------------------

# name -> (element type, declared shape); "N" is shared by x and y (Add broadcasts them)
DECLARED = {
    "x": (TensorProto.FLOAT, ["N", 4]),
    "y": (TensorProto.FLOAT, ["N", 4]),
    "ids": (TensorProto.INT64, ["M"]),
    "h": (TensorProto.FLOAT16, [2, "K", 3]),
    "flag": (TensorProto.BOOL, [2]),
    "scalar": (TensorProto.FLOAT, []),                 # rank 0: ORT checks no shape
    "bias": (TensorProto.FLOAT, [4]),                  # with an initializer: may be left out
}
NP = {TensorProto.FLOAT: np.float32, TensorProto.INT64: np.int64, TensorProto.FLOAT16: np.float16,
      TensorProto.BOOL: np.bool_}
REQUIRED = [n for n in DECLARED if n != "bias"]
RANKED = [n for n in DECLARED if DECLARED[n][1]]                     # every input but the rank-0 one
STATIC = [(n, axis, d) for n, (_, shape) in DECLARED.items() for axis, d in enumerate(shape) if isinstance(d, int)]
WRONG_DTYPES = [np.float32, np.float64, np.float16, np.int64, np.int32, np.uint8, np.bool_]


def few_node_model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Add", ["x", "y"], ["xy"]),
        helper.make_node("Add", ["xy", "bias"], ["s"]),
        helper.make_node("Mul", ["s", "scalar"], ["out"]),
        helper.make_node("Identity", ["ids"], ["ids_out"]),
        helper.make_node("Cast", ["h"], ["h32"], to=TensorProto.FLOAT),
        helper.make_node("Not", ["flag"], ["not_flag"]),
    ]
    graph = helper.make_graph(
        nodes, "few", [helper.make_tensor_value_info(n, t, shape) for n, (t, shape) in DECLARED.items()],
        [helper.make_tensor_value_info(n, t, None) for n, t in
         (("out", TensorProto.FLOAT), ("ids_out", TensorProto.INT64), ("h32", TensorProto.FLOAT),
          ("not_flag", TensorProto.BOOL))],
        initializer=[numpy_helper.from_array(np.arange(4, dtype=np.float32), "bias")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


MODEL = few_node_model()


def valid_feeds(rng, N=2, M=3, K=5) -> dict:
    return {"x": rng.standard_normal((N, 4)).astype(np.float32), "y": rng.standard_normal((N, 4)).astype(np.float32),
            "ids": rng.integers(-5, 5, M), "h": rng.standard_normal((2, K, 3)).astype(np.float16),
            "flag": rng.random(2) < 0.5, "scalar": np.array(rng.standard_normal(), np.float32)}


@pytest.fixture(scope="module")
def sessions():
    """(deltarule.onnx.Session, onnxruntime.InferenceSession) of the few-node model."""
    return (donnx.Session(MODEL),
            ort.InferenceSession(MODEL.SerializeToString(), providers=["CPUExecutionProvider"]))


def refused(session, feeds, argument: str) -> ContractError:
    """`feeds` raises ContractError naming `argument` (and no ORT sub-model was built)."""
    before = [len(s.sessions) for s in session._steps if hasattr(s, "sessions")]
    with pytest.raises(ContractError, match=rf"^{argument}: expected") as info:
        session.run(None, feeds)
    assert info.value.argument == argument, info.value
    assert [len(s.sessions) for s in session._steps if hasattr(s, "sessions")] == before
    return info.value


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_array_equal(g, w)


@EXAMPLES
@given(seed=st.integers(0, 2**16), N=st.integers(1, 4), M=st.integers(0, 4), K=st.integers(0, 3),
       with_bias=st.booleans())
def test_valid_feeds_give_onnxruntime_outputs(sessions, seed, N, M, K, with_bias):
    ours, theirs = sessions
    feeds = valid_feeds(np.random.default_rng(seed), N, M, K)
    if with_bias:
        feeds["bias"] = np.full(4, 0.5, np.float32)
    assert_same(ours.run(None, feeds), theirs.run(None, feeds))


def test_what_onnxruntime_accepts_stays_accepted(sessions):
    """Symbolic dimensions are free (x [1, 4] + y [3, 4] broadcasts, as in ORT), a rank-0
    input takes any shape (ORT checks none), and lists are converted to the declared type."""
    ours, theirs = sessions
    rng = np.random.default_rng(0)
    feeds = valid_feeds(rng, N=3)
    for change in (dict(x=feeds["x"][:1]), dict(scalar=np.ones(4, np.float32)),
                   dict(ids=[1, 2, 3], flag=[True, False], x=feeds["x"].tolist()),
                   dict(x=np.asfortranarray(feeds["x"]), h=feeds["h"][:, ::2])):
        assert_same(ours.run(None, {**feeds, **change}), theirs.run(None, {**feeds, **change}))


@pytest.mark.parametrize("name", REQUIRED)
def test_a_missing_input_is_refused(sessions, name):
    ours, theirs = sessions
    feeds = valid_feeds(np.random.default_rng(1))
    del feeds[name]
    with pytest.raises(Exception, match="missing"):
        theirs.run(None, feeds)
    refused(ours, feeds, name)


def test_an_unknown_feed_is_refused(sessions):
    ours, theirs = sessions
    feeds = dict(valid_feeds(np.random.default_rng(2)), xy=np.zeros((2, 4), np.float32))
    with pytest.raises(Exception, match="Invalid input name"):
        theirs.run(None, feeds)
    assert "xy" in str(refused(ours, feeds, "feeds"))
    refused(ours, [feeds["x"]], "feeds")


@EXAMPLES
@given(name=st.sampled_from(list(DECLARED)), dtype=st.sampled_from(WRONG_DTYPES), seed=st.integers(0, 99))
def test_a_wrong_element_type_is_refused(sessions, name, dtype, seed):
    """As ORT: no conversion of an array (a float16 state for a float32 input stayed float16)."""
    ours, theirs = sessions
    declared = NP[DECLARED[name][0]]
    feeds = valid_feeds(np.random.default_rng(seed))
    feeds.setdefault(name, np.zeros(4, np.float32))
    feeds[name] = feeds[name].astype(dtype)
    note(f"{name}: {feeds[name].dtype} for {np.dtype(declared)}")
    if dtype is declared:
        assert_same(ours.run(None, feeds), theirs.run(None, feeds))
        return
    with pytest.raises(Exception, match="Unexpected input data type"):
        theirs.run(None, feeds)
    err = refused(ours, feeds, name)
    assert str(np.dtype(declared)) in err.expected and err.actual == str(np.dtype(dtype))


@EXAMPLES
@given(name=st.sampled_from(RANKED), rank=st.integers(0, 4), seed=st.integers(0, 99))
def test_a_wrong_rank_is_refused(sessions, name, rank, seed):
    ours, theirs = sessions
    feeds = valid_feeds(np.random.default_rng(seed))
    declared = len(DECLARED[name][1])
    if rank == declared:
        rank += 1
    feeds[name] = np.zeros((1,) * rank, NP[DECLARED[name][0]])
    with pytest.raises(Exception, match="Invalid rank"):
        theirs.run(None, feeds)
    assert f"rank {declared}" in refused(ours, feeds, name).expected


@EXAMPLES
@given(where=st.sampled_from(STATIC), size=st.integers(0, 6), seed=st.integers(0, 99))
def test_a_wrong_static_dimension_is_refused(sessions, where, size, seed):
    ours, theirs = sessions
    name, axis, declared = where
    feeds = valid_feeds(np.random.default_rng(seed))
    feeds.setdefault(name, np.zeros(4, np.float32))
    if size == declared:
        size += 1
    shape = list(feeds[name].shape)
    shape[axis] = size
    feeds[name] = np.zeros(shape, feeds[name].dtype)
    with pytest.raises(Exception, match="invalid dimensions"):
        theirs.run(None, feeds)
    assert f"dimension {axis} is {declared}" in refused(ours, feeds, name).expected


@pytest.mark.parametrize("value, why", [([1.5, 2.0], "list of float64"), ([2**70], "list of object"),
                                        ([[1], [2, 3]], "inhomogeneous"), ("abc", "<U3")])
def test_a_list_that_does_not_convert_without_loss_is_refused(sessions, value, why):
    """ORT truncates [1.5, 2.0] to an int64 input; deltarule refuses it (and what ORT refuses)."""
    ours, _ = sessions
    err = refused(ours, dict(valid_feeds(np.random.default_rng(3)), ids=value), "ids")
    assert why in str(err.actual)


def test_a_float16_past_state_for_a_float32_graph_is_refused():
    """The gdn2 block's state input is float32 [1, 2, 4, 4]: a float16 one came back float16
    (the state changed dtype between steps); a wider one failed inside the kernel."""
    model, feeds = bench.gdn2_block(T=3, B=1, d_model=8, heads=2, d_k=4, d_v=4, past_state=True)
    session = donnx.Session(model)
    y, state = session.run(None, feeds)
    assert state.dtype == np.float32
    refused(session, dict(feeds, past=state.astype(np.float16)), "past")
    refused(session, dict(feeds, past=np.zeros((1, 2, 4, 5), np.float32)), "past")
    refused(session, dict(feeds, x=feeds["x"][..., :7]), "x")
    np.testing.assert_array_equal(session.run(None, dict(feeds, past=state))[1],
                                  donnx.run(model, dict(feeds, past=state))[1])


def test_the_declared_inputs_are_read_once(sessions, monkeypatch):
    """Session.run reads no graph: the check uses the inputs read when the Session was built."""
    ours, _ = sessions
    assert isinstance(ours.inputs, Inputs) and ours.inputs.names == list(DECLARED)
    assert ours.inputs.required == REQUIRED
    monkeypatch.setattr(Inputs, "of_graph", classmethod(lambda cls, graph: pytest.fail("inputs read again")))
    ours.run(None, valid_feeds(np.random.default_rng(4)))


# ---------------------------------------------------------------------------
# model files
# ---------------------------------------------------------------------------

def test_every_truncation_of_a_model_is_refused_or_runs_as_the_whole():
    """Every prefix of a model's bytes (as bytes and as a file) either is refused naming
    `model`, or is the model less trailing fields nothing reads (a cut at a field boundary
    after the graph and the first opset import) and gives the whole model's outputs."""
    model = few_node_model()
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    helper.set_model_props(model, {"a": "1", "b": "2"})
    data = model.SerializeToString()
    feeds = valid_feeds(np.random.default_rng(5))
    want = donnx.run(model, feeds)
    ran = 0
    for n in range(len(data)):
        try:
            session = donnx.Session(data[:n])
        except ContractError as exc:
            assert exc.argument == "model", exc
            continue
        assert_same(session.run(None, feeds), want)
        ran += 1
    assert 0 < ran < 6, ran                                # the metadata and second-opset cuts only


@pytest.mark.parametrize("cut", [0, 1, 2, 100, -1])
def test_a_truncated_or_unreadable_file_is_refused(tmp_path, cut):
    data = few_node_model().SerializeToString()
    path = tmp_path / "model.onnx"
    path.write_bytes(data[:cut])
    with pytest.raises(ContractError, match="^model: ") as info:
        donnx.Session(str(path))
    assert info.value.argument == "model"
    with pytest.raises(ContractError, match="^model: .*FileNotFoundError"):
        donnx.run(str(tmp_path / "absent.onnx"), {})
    with pytest.raises(ContractError, match="^model: .*IsADirectoryError"):
        donnx.Session(tmp_path)


def test_truncated_or_missing_external_data_is_refused(tmp_path):
    """A short or absent external-data file: ContractError naming the model (onnx 1.23's loader
    raises a plain ValueError or ValidationError; DecoderSession reads no external data, and ORT
    ran this one: the short tensor is unused)."""
    model = few_node_model()
    weights = np.arange(4096, dtype=np.float32)
    model.graph.initializer.append(numpy_helper.from_array(weights, "unused"))
    path = str(tmp_path / "model.onnx")
    onnx.save_model(onnx.ModelProto.FromString(model.SerializeToString()), path, save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.data", size_threshold=0)
    feeds = valid_feeds(np.random.default_rng(6))
    assert_same(donnx.run(path, feeds), donnx.run(model, feeds))
    data = tmp_path / "model.data"
    data.write_bytes(data.read_bytes()[:-8])
    with pytest.raises(ContractError, match="^model: .*truncated"):
        donnx.Session(path)
    data.unlink()
    with pytest.raises(ContractError, match="^model: .*external data"):
        donnx.Session(path)


def test_a_model_whose_external_data_is_not_loaded_is_refused(tmp_path):
    """`onnx.load(path, load_external_data=False)` (or its bytes) handed over: nothing says where
    the data lies; ORT failed on it only when the first segment ran."""
    model = few_node_model()
    path = str(tmp_path / "model.onnx")
    onnx.save_model(onnx.ModelProto.FromString(model.SerializeToString()), path, save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.data", size_threshold=0)      # (saving edits it)
    unloaded = onnx.load(path, load_external_data=False)
    for given in (unloaded, unloaded.SerializeToString()):
        with pytest.raises(ContractError, match="^model: .*'bias' refers to external data"):
            donnx.Session(given)
    feeds = valid_feeds(np.random.default_rng(7))
    assert_same(donnx.run(onnx.load(path), feeds), donnx.run(model, feeds))


@pytest.mark.parametrize("names, why", [(["nope"], "'nope'"), (["out", "xy_typo"], "'xy_typo'"), ("out", "'out'")],
                         ids=["unknown", "one-of-two", "a-string"])
def test_unknown_output_names_are_refused_before_running(sessions, names, why):
    session, _ = sessions
    before = [len(s.sessions) for s in session._steps if hasattr(s, "sessions")]
    with pytest.raises(ContractError, match=f"^output_names: expected .*got {why}"):
        session.run(names, valid_feeds(np.random.default_rng(8)))
    assert [len(s.sessions) for s in session._steps if hasattr(s, "sessions")] == before
    assert_same(session.run(["out"], valid_feeds(np.random.default_rng(8))),
                sessions[1].run(["out"], valid_feeds(np.random.default_rng(8))))


# ---------------------------------------------------------------------------
# DecoderSession
# ---------------------------------------------------------------------------

from deltarule.onnx.export.generate import DecoderSession  # noqa: E402


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny Qwen3.5 decoder (vocabulary 256): linear and full-attention layers, states
    past_conv.0 [batch_size, 256, 3], past_recurrent.0, past_key_values.1.key / value
    [batch_size, 1, past_sequence_length, 64]."""
    pytest.importorskip("onnxscript")
    pytest.importorskip("transformers")
    import deltarule.onnx.export
    from deltarule.tools.bench import checkpoints
    root = tmp_path_factory.mktemp("decoder")
    ck = checkpoints.save("qwen3_5", str(root / "ck"))
    return deltarule.onnx.export.export_model(ck, str(root / "out")).path


class Counting:
    """A session whose runs are counted."""

    def __init__(self, session):
        self.session, self.calls = session, 0

    def run(self, *args, **kwargs):
        self.calls += 1
        return self.session.run(*args, **kwargs)


@pytest.fixture(scope="module")
def decoder(export):
    session = DecoderSession(export)
    session.session = Counting(session.session)
    return session


def refuses(argument: str, fn, *args, **kwargs) -> ContractError:
    """`fn(*args, **kwargs)` raises ContractError naming `argument`."""
    with pytest.raises(ContractError, match=rf"^{re.escape(argument)}: expected") as info:
        fn(*args, **kwargs)
    assert info.value.argument == argument, info.value
    return info.value


PROMPT = np.array([[5, 9, 200], [7, 1, 30]], np.int64)


def test_the_vocabulary_is_the_embedding_tables(decoder):
    assert decoder.vocab == 256
    logits, _ = decoder.step(PROMPT, np.ones((2, 3), np.int64), decoder.zero_state(2))
    assert logits.shape == (2, 3, 256)


@pytest.mark.parametrize("prompt, why", [
    ([[5, 9]], "list"),
    (np.array([[5.0, 9.0]]), "float64"),
    (np.array([[True]]), "bool"),
    (np.array([5, 9]), "shape [2]"),
    (np.zeros((1, 2, 3), np.int64), "shape [1, 2, 3]"),
    (np.zeros((2, 0), np.int64), "shape [2, 0]"),
    (np.zeros((0, 3), np.int64), "shape [0, 3]"),
    (np.array([[5, -1, 9]]), "prompt[0, 1] = -1"),
    (np.array([[5, 9], [256, 1]]), "prompt[1, 0] = 256"),
    (np.array([[2**40]], np.uint64), "= 1099511627776"),
], ids=["list", "float", "bool", "1-D", "3-D", "empty", "no-rows", "negative", "vocab", "uint64-huge"])
def test_greedy_refuses_a_prompt(decoder, prompt, why):
    before = decoder.session.calls
    err = refuses("prompt", decoder.greedy, prompt, 2)
    assert why in str(err.actual)
    assert decoder.session.calls == before


@EXAMPLES
@given(B=st.integers(1, 3), T=st.integers(1, 5), seed=st.integers(0, 2**16),
       bad=st.one_of(st.integers(-2**40, -1), st.integers(256, 2**40)), data=st.data())
def test_token_ids_outside_the_vocabulary_are_refused(decoder, B, T, seed, bad, data):
    """-1 read the last row of the embedding (the last token's logits), 256 failed in Gather."""
    ids = np.random.default_rng(seed).integers(0, 256, (B, T))
    where = (data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, T - 1)))
    ids[where] = bad
    before = decoder.session.calls
    assert str(bad) in str(refuses("ids", decoder.step, ids, np.ones((B, T), np.int64), decoder.zero_state(B)).actual)
    assert f"prompt{list(where)}" in str(refuses("prompt", decoder.greedy, ids, 1).actual)
    assert decoder.session.calls == before


@pytest.mark.parametrize("kwargs, argument", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(max_new_tokens=2, eos_token_id=[1, 2]), "eos_token_id"),
    (dict(max_new_tokens=2, eos_token_id="1"), "eos_token_id"),
    (dict(max_new_tokens=2, pad_token_id=None), "pad_token_id"),
])
def test_greedy_refuses_its_other_arguments(decoder, kwargs, argument):
    before = decoder.session.calls
    refuses(argument, decoder.greedy, PROMPT, **kwargs)
    assert decoder.session.calls == before


def test_a_pad_token_outside_the_vocabulary_is_returned_but_never_fed(export):
    """A row that produced eos continues with pad_token_id; a pad that is no token id (-1)
    is still returned there, and the other rows' tokens are those of pad 0."""
    session = DecoderSession(export)
    first = session.greedy(PROMPT, 1)[0, 0]
    a = session.greedy(PROMPT, 4, eos_token_id=int(first), pad_token_id=0)
    b = session.greedy(PROMPT, 4, eos_token_id=int(first), pad_token_id=-1)
    after = np.cumsum(np.cumsum(a == first, axis=1), axis=1) > 1           # after each row's first eos
    assert after[0, 1:].all()
    np.testing.assert_array_equal(b[~after], a[~after])
    assert (b[after] == -1).all() and (a[after] == 0).all()


def _past(decoder, B=2, T=3):
    _, past = decoder.step(PROMPT[:B, :T], np.ones((B, T), np.int64), decoder.zero_state(B))
    return past


@pytest.mark.parametrize("mask, why", [
    ([[1, 1, 1, 1]], "list"),
    (np.ones((2, 4), "U1"), "<U1"),
    (np.ones((1, 4), np.int64), "shape [1, 4]"),
    (np.ones((2, 4, 1), np.int64), "shape [2, 4, 1]"),
    (np.ones((2, 0), np.int64), "shape [2, 0]"),              # shorter than the ids
    (np.full((2, 5), 2, np.int64), "values [2]"),
], ids=["list", "str", "batch", "3-D", "short", "not-0-1"])
def test_step_refuses_a_mask(decoder, mask, why):
    err = refuses("mask", decoder.step, PROMPT[:, :1], mask, _past(decoder))
    assert why in str(err.actual)


def test_step_refuses_a_past_that_does_not_fit(decoder):
    """As ORT: names, element type, rank, static dims; and the batch and the past length the
    ids and the mask give (a mask of the wrong length ran, its positions shifted)."""
    past, mask = _past(decoder), np.ones((2, 4), np.int64)
    ids = PROMPT[:, :1]
    before = decoder.session.calls
    conv = "past['past_conv.0']"
    refuses(conv, decoder.step, ids, mask, {**past, "past_conv.0": past["past_conv.0"].astype(np.float16)})
    refuses(conv, decoder.step, ids, mask, {**past, "past_conv.0": np.zeros((2, 256, 4), np.float32)})
    refuses(conv, decoder.step, ids, mask, {**past, "past_conv.0": past["past_conv.0"][None]})
    refuses(conv, decoder.step, ids, mask, {k: v for k, v in past.items() if k != "past_conv.0"})
    refuses("past", decoder.step, ids, mask, {**past, "attention_mask": mask})
    refuses("past", decoder.step, ids, mask, list(past.values()))
    refuses(conv, decoder.step, PROMPT[:1, :1], mask[:1], past)                       # batch 1 of 2
    key = "past['past_key_values.1.key']"
    assert "past length" in refuses(key, decoder.step, ids, np.ones((2, 5), np.int64), past).expected
    assert "past length" in refuses(key, decoder.step, PROMPT, np.ones((2, 5), np.int64),
                                    decoder.zero_state(2)).expected
    refuses("batch", decoder.zero_state, 0)
    assert decoder.session.calls == before
    decoder.step(ids, mask, past)
    assert decoder.session.calls == before + 1


@EXAMPLES
@given(name=st.sampled_from(["past_conv.0", "past_recurrent.0", "past_key_values.1.key",
                             "past_key_values.1.value"]),
       change=st.sampled_from(["dtype", "rank", "axis"]), data=st.data())
def test_any_past_input_that_does_not_fit_is_refused(decoder, name, change, data):
    past = _past(decoder)
    x = past[name]
    if change == "dtype":
        x = x.astype(data.draw(st.sampled_from([np.float16, np.float64, np.int64])))
    elif change == "rank":
        x = x[..., None] if data.draw(st.booleans()) else x[0]
    else:
        axis = data.draw(st.integers(0, x.ndim - 1))
        shape = list(x.shape)
        shape[axis] += data.draw(st.integers(1, 3))
        x = np.zeros(shape, x.dtype)
    note(f"{name}: {x.dtype} {x.shape}")
    refuses(f"past[{name!r}]", decoder.step, PROMPT[:, :1], np.ones((2, 4), np.int64), {**past, name: x})


def test_valid_steps_give_the_deltarule_runners_tokens_and_onnxruntimes_logits(export, decoder):
    """The checks change no valid call: the deltarule runner's greedy tokens and logits
    are onnxruntime's, and a bool or 0 / 1 float mask is taken as the int64 one."""
    ours = DecoderSession(export, runner="deltarule")
    np.testing.assert_array_equal(ours.greedy(PROMPT, 4), decoder.greedy(PROMPT, 4))
    want = decoder.session.session.run(None, {"input_ids": PROMPT, "attention_mask": np.ones((2, 3), np.int64),
                                              **decoder.zero_state(2)})[0]
    for mask in (np.ones((2, 3), np.int64), np.ones((2, 3), bool), np.ones((2, 3))):
        got, _ = decoder.step(PROMPT, mask, decoder.zero_state(2))
        np.testing.assert_array_equal(got, want)


def test_decoder_session_refuses_bad_files_and_arguments(export, tmp_path):
    data = open(export, "rb").read()
    for cut in (0, 1, 1000, len(data) // 2, len(data) - 1):
        path = tmp_path / f"cut{cut}.onnx"
        path.write_bytes(data[:cut])
        refuses("path", DecoderSession, str(path))
    refuses("path", DecoderSession, str(tmp_path / "absent.onnx"))
    refuses("path", DecoderSession, data)
    refuses("runner", DecoderSession, str(tmp_path / "absent.onnx"), runner="onnx")      # before reading
    refuses("runner", DecoderSession, export, runner=None)
    refuses("threads", DecoderSession, export, threads="2")
    refuses("sizes['kv_cache_dim']", DecoderSession, export, sizes={"kv_cache_dim": -1})
    refuses("embed", DecoderSession, export, embed=str(tmp_path / "absent.onnx"))
    refuses("embed", DecoderSession, export, embed=export)            # a decoder taking input_ids


def test_an_output_without_a_past_input_is_refused_naming_the_path(export, tmp_path):
    model = onnx.load(export)
    model.graph.node.append(helper.make_node("Identity", ["logits"], ["present_extra"]))
    model.graph.output.append(helper.make_tensor_value_info("present_extra", TensorProto.FLOAT, None))
    path = str(tmp_path / "extra.onnx")
    onnx.save(model, path)
    err = refuses("path", DecoderSession, path)
    assert isinstance(err, ValueError) and "output 'present_extra' has no past input" in str(err)


def toy_decoder(path: str, *, rows: int, width: int | None, constant: bool = False) -> str:
    """A decoder with no state: logits = table[input_ids] ([rows, width]); the table an
    initializer or (constant) a Constant node's; logits declared [batch, sequence, width or
    symbolic "vocab"]."""
    table = np.random.default_rng(7).standard_normal((rows, width or rows)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["logits"])]
    inits = [numpy_helper.from_array(table, "table")]
    if constant:
        nodes.insert(0, helper.make_node("Constant", [], ["table"], value=inits.pop()))
    graph = helper.make_graph(
        nodes, "toy",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                       ["batch_size", "sequence_length", width or "vocab"])],
        initializer=inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), path)
    return path


def test_the_vocabulary_is_the_tables_rows_else_the_logits_width(tmp_path):
    """Ids index the embedding table: its rows bound them even where the logits are narrower;
    without a table initializer, the logits' static width."""
    wide = DecoderSession(toy_decoder(str(tmp_path / "a.onnx"), rows=7, width=5))
    assert wide.vocab == 7
    assert wide.step(np.array([[6]]), np.ones((1, 1), np.int64), {})[0].shape == (1, 1, 5)
    refuses("ids", wide.step, np.array([[7]]), np.ones((1, 1), np.int64), {})
    narrow = DecoderSession(toy_decoder(str(tmp_path / "b.onnx"), rows=6, width=6, constant=True))
    assert narrow.vocab == 6
    refuses("prompt", narrow.greedy, np.array([[6]]), 1)


def test_a_symbolic_vocabulary_refuses_negative_ids_and_leaves_the_bound_to_the_runtime(tmp_path):
    session = DecoderSession(toy_decoder(str(tmp_path / "c.onnx"), rows=6, width=None, constant=True))
    assert session.vocab is None
    tokens = session.greedy(np.array([[1, 2]]), 3)
    assert tokens.shape == (1, 3) and ((0 <= tokens) & (tokens < 6)).all()
    err = refuses("prompt", session.greedy, np.array([[1, -1]]), 1)
    assert "[0, vocab)" in err.expected
    with pytest.raises(Exception, match="out of data bounds|indices"):
        session.greedy(np.array([[6]]), 1)


def test_a_decoder_onnxruntime_cannot_load_is_refused_naming_the_path(tmp_path):
    """A file that parses but that ORT refuses (here a node of an op no domain defines): the
    session is built in the constructor, so the error is the constructor's ContractError."""
    path = toy_decoder(str(tmp_path / "d.onnx"), rows=6, width=6)
    model = onnx.load(path)
    model.graph.node.append(helper.make_node("NoSuchOp", ["logits"], ["unused"]))
    onnx.save(model, path)
    err = refuses("path", DecoderSession, path)
    assert "NoSuchOp" in str(err.actual)
