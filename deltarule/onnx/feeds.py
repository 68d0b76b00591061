"""A model's declared inputs, and feeds and model files checked against them up front.

`Inputs` reads a graph's inputs once (per session) and `Inputs.check` refuses a run's
feeds with `ContractError` naming the input, before any work, where ONNX Runtime 1.32's
`InferenceSession.run` refuses them (or runs them wrongly):

- a required input (one without an initializer) missing; a feed name that is no input;
- an element type other than the declared one (no silent conversion: a float16 array
  for a float32 input, float ids for an int64 input, a non-native byte order);
- a rank other than the declared one, and a size other than a static dimension's.

What ORT does not check is not checked either: symbolic dimensions (``dim_param``) are
free, also between inputs that share a name (ORT runs ``Add(x [N, 4], y [N, 4])`` with
N = 1 and N = 2, broadcasting), and an input declared with rank 0 (``[]``) takes any
shape (ORT checks no shape for it). Python lists, tuples and scalars are converted to
the declared element type as ORT converts a list, but only where the conversion loses
nothing (numbers to a float type, integers in range to an integer type, bools to bool);
ORT also truncates ``[1.5]`` to an int64 input, which this refuses. Other values
(NumPy arrays and scalars, anything with ``__array__``) are taken as `numpy.asarray`
gives them, their element type as it is. Inputs that are not tensors (sequences,
maps, optionals), and element types without a NumPy type (bfloat16, float8, int4: ORT's
Python API takes them only as OrtValues) are passed on unchecked.

`load` reads a model given as a path or bytes, refusing an unreadable or truncated file
(`ContractError` naming the argument) where onnx's loader would raise `DecodeError`,
`OSError`, or return the empty or partial model of a file cut at a field boundary.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from ..errors import ContractError

__all__ = ["Input", "Inputs", "load"]

# Python values converted to the declared element type (as ORT converts a list); exact types for
# the scalars, so NumPy's float64 and complex128 scalars (subclasses of float and complex) are not
_SEQUENCES = (list, tuple)
_SCALARS = (int, float, bool, complex)
# element-type kind -> the kinds of a converted Python value's array it takes without loss
# (integer targets: also only in range, checked by a round trip)
_TAKES = {"f": "biuf", "c": "biufc", "i": "biu", "u": "biu", "b": "b", "O": "USO"}


def _name(label, name: str) -> str:
    return name if label is None else label(name)


class Input:
    """One declared graph input: its name, element type and shape.

    `dtype`: the NumPy element type (None: not checked); `dims`: a size per axis, None for a
    symbolic or unknown dimension (the whole tuple None: no shape declared, or rank 0)."""

    __slots__ = ("name", "elem_type", "dtype", "type_text", "dims", "shape_text", "_static")

    def __init__(self, value: onnx.ValueInfoProto):
        self.name = value.name
        self.elem_type = None
        self.dtype = None
        self.dims = None
        self.type_text = self.shape_text = "any"
        self._static = ()
        if value.type.WhichOneof("value") != "tensor_type":
            return
        tensor = value.type.tensor_type
        self.elem_type = tensor.elem_type
        if tensor.elem_type:
            self.type_text = f"tensor({helper.tensor_dtype_to_string(tensor.elem_type).split('.')[-1].lower()})"
            try:
                dtype = helper.tensor_dtype_to_np_dtype(tensor.elem_type)
            except Exception:                        # pragma: no cover - an element type onnx does not know
                dtype = None
            if dtype is not None and dtype.type.__module__ == "numpy" and dtype.kind in _TAKES:
                self.dtype = dtype
        if tensor.HasField("shape") and len(tensor.shape.dim):
            dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
            self.dims = dims
            self.shape_text = "[" + ", ".join(
                str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor.shape.dim) + "]"
            self._static = tuple((axis, d) for axis, d in enumerate(dims) if d is not None)

    def _expected_type(self) -> str:
        return f"element type {self.dtype} (the graph declares {self.type_text})"

    def array(self, x, argument: str) -> np.ndarray:
        """`x` as this input's array (a Python list / tuple / scalar converted without loss);
        ContractError(argument, ...) where the element type, rank or a static dimension differs."""
        if isinstance(x, np.ndarray):
            a = x
        elif self.dtype is not None and (isinstance(x, _SEQUENCES) or type(x) in _SCALARS):
            a = self._converted(x, argument)
        else:
            try:
                a = np.asarray(x)
            except Exception as exc:
                raise ContractError(argument, "an array", f"{type(x).__name__} ({exc})") from exc
        dtype = self.dtype
        if dtype is not None and a.dtype != dtype:
            if not (dtype.kind == "O" and a.dtype.kind in "USO"):
                raise ContractError(argument, self._expected_type(), str(a.dtype))
        dims = self.dims
        if dims is not None:
            if a.ndim != len(dims):
                raise ContractError(argument, f"rank {len(dims)} (shape {self.shape_text})",
                                    f"rank {a.ndim} (shape {list(a.shape)})")
            shape = a.shape
            for axis, size in self._static:
                if shape[axis] != size:
                    raise ContractError(argument, f"shape {self.shape_text} (dimension {axis} is {size})",
                                        f"shape {list(shape)}")
        return a

    def _converted(self, x, argument: str) -> np.ndarray:
        dtype = self.dtype
        try:
            a = np.asarray(x)
        except Exception as exc:
            raise ContractError(argument, f"an array of {self.type_text}", f"{type(x).__name__} ({exc})") from exc
        if a.dtype == dtype or a.size == 0:
            return a.astype(dtype, copy=False)
        if a.dtype.kind not in _TAKES[dtype.kind]:
            raise ContractError(argument, f"{self._expected_type()} (a {type(x).__name__} of values convertible "
                                "without loss)", f"a {type(x).__name__} of {a.dtype}")
        if dtype.kind == "O":
            return a
        with np.errstate(all="ignore"):
            b = a.astype(dtype)
        if dtype.kind in "iu" and not np.array_equal(b, a):
            raise ContractError(argument, f"{self._expected_type()}: values in its range",
                                f"a {type(x).__name__} with values outside it")
        return b


class Inputs:
    """A graph's declared inputs, read once; `check` refuses feeds against them.

    Args:
        values: the inputs (`onnx.ValueInfoProto`s, e.g. ``graph.input``).
        defaults: the names of those with a default (an initializer): not required.
    """

    def __init__(self, values: Sequence[onnx.ValueInfoProto], defaults: Collection[str] = ()):
        self.declared = {v.name: Input(v) for v in values}
        self.names = list(self.declared)
        self.required = [n for n in self.names if n not in defaults]

    @classmethod
    def of_graph(cls, graph: onnx.GraphProto) -> Inputs:
        return cls(graph.input, {t.name for t in graph.initializer} | {t.values.name for t in graph.sparse_initializer})

    def check(self, feeds, *, argument: str = "feeds", label: Callable[[str], str] | None = None) -> dict:
        """The feeds as arrays (input name -> array, in graph order), or ContractError before
        any work: `argument` named for a non-mapping or a name that is no input, the input
        (``label(name)`` where given) for a missing one or a wrong element type, rank or
        static dimension."""
        if not isinstance(feeds, Mapping):
            raise ContractError(argument, "a mapping from input name to array", type(feeds).__name__)
        declared = self.declared
        unknown = [n for n in feeds if n not in declared]
        if unknown:
            raise ContractError(argument, f"names among the graph inputs {self.names}", sorted(unknown, key=str))
        for name in self.required:
            if name not in feeds:
                raise ContractError(_name(label, name), "a feed (a graph input without a default)", "missing")
        return {name: declared[name].array(feeds[name], _name(label, name)) for name in self.names if name in feeds}


def load(model, argument: str = "model", *, load_external_data: bool = True) -> onnx.ModelProto:
    """`model` (a path, serialized bytes or an `onnx.ModelProto`) as a ModelProto.

    A path or bytes that does not parse, a file that cannot be read, a model without a
    graph or an opset import (what is left of a file cut at a field boundary; ORT refuses
    it too), or external data missing or shorter than the model says: ContractError naming
    `argument`. A ModelProto is returned as it is, unless its tensors still refer to external
    data (``onnx.load(path, load_external_data=False)``): that and bytes doing so are refused,
    as nothing says where the data lies (pass the path)."""
    if isinstance(model, onnx.ModelProto):
        _check_no_external_data(model, argument, "the onnx.ModelProto")
        return model
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        what = f"{path!r}"
        try:
            proto = onnx.load(path, load_external_data=False)
        except Exception as exc:
            raise ContractError(argument, "a readable ONNX model file", f"{what} ({type(exc).__name__}: {exc})") \
                from exc
    elif isinstance(model, (bytes, bytearray, memoryview)):
        path, what = None, f"{len(model)} bytes"
        try:
            proto = onnx.load_from_string(bytes(model))
        except Exception as exc:
            raise ContractError(argument, "a serialized onnx.ModelProto", f"unparsable bytes ({exc})") from exc
    else:
        raise ContractError(argument, "an onnx.ModelProto, bytes or a path", type(model).__name__)
    if not proto.HasField("graph"):
        raise ContractError(argument, "an ONNX model with a graph (a whole file, not a truncated one)",
                            f"{what}: no graph")
    if not len(proto.opset_import):
        raise ContractError(argument, "an ONNX model with an opset import (a whole file, not a truncated one)",
                            f"{what}: none")
    if path is None:
        _check_no_external_data(proto, argument, what)
    else:
        base = os.path.dirname(path)
        _check_external_data(proto, base, argument, what)
        if load_external_data:
            try:
                onnx.load_external_data_for_model(proto, base)
            except Exception as exc:
                raise ContractError(argument, "an ONNX model whose external data reads",
                                    f"{what} ({type(exc).__name__}: {exc})") from exc
    return proto


def _external_tensors(proto: onnx.ModelProto) -> list:
    """The model's tensors whose data lies in an external file."""
    from onnx import external_data_helper

    tensors = getattr(external_data_helper, "_get_all_tensors", lambda m: m.graph.initializer)(proto)
    return [t for t in tensors if external_data_helper.uses_external_data(t)]


def _check_no_external_data(proto: onnx.ModelProto, argument: str, what: str) -> None:
    external = _external_tensors(proto)
    if external:
        raise ContractError(argument, "a model with its external data loaded (or its path, to read the data "
                            "from beside it)", f"{what}: tensor {external[0].name!r} refers to external data")


def _check_external_data(proto: onnx.ModelProto, base: str, argument: str, what: str) -> None:
    """Every external-data file the model names exists and holds the bytes it names."""
    from onnx import external_data_helper

    need: dict[str, int] = {}
    for tensor in _external_tensors(proto):
        info = external_data_helper.ExternalDataInfo(tensor)
        file = os.path.join(base, info.location)
        end = (info.offset or 0) + (info.length or 0)
        need[file] = max(need.get(file, 0), end)
    for file, end in need.items():
        try:
            size = os.path.getsize(file)
        except OSError as exc:
            raise ContractError(argument, "an ONNX model whose external data files exist",
                                f"{what}: {type(exc).__name__}: {exc}") from exc
        if size < end:
            raise ContractError(argument, f"external data {file!r} of at least {end} bytes (the model's)",
                                f"{what}: {size} bytes (a truncated file)")
