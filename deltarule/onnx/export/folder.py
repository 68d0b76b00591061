"""The export's output folder: checked before the trace, written whole or not at all.

An export writes into a temporary folder beside `out_dir` (``.<name>.<random>.partial``)
and moves it into place at the end: a new `out_dir` is one rename; an existing one
(empty, or with ``overwrite``) first loses what an export writes (``onnx/`` first, so no
stale model loads meanwhile), then gets the new files, ``onnx/`` last. An export that fails
or is killed before that leaves no model in `out_dir` (a killed one may leave the hidden
partial folder beside it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from ...errors import ContractError
from ...tools.paths import writable_folder

# files copied from the checkpoint beside the model (those present)
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
          "chat_template.json", "added_tokens.json", "preprocessor_config.json")
MODEL_FOLDER = "onnx"
# what an export writes into out_dir (what overwrite clears)
WRITTEN = (MODEL_FOLDER, "genai_config.json", *COPIED)


def check_out_dir(out_dir, model_dir: str, *, overwrite: bool) -> str:
    """`out_dir` as a ``str`` if the export may write there, else `ContractError` naming it:
    a writable folder (made if absent), not the checkpoint, not inside it and not around it,
    and empty unless `overwrite`."""
    out_dir = writable_folder("out_dir", out_dir)
    out, model = os.path.realpath(out_dir), os.path.realpath(model_dir)
    if out == model:
        raise ContractError("out_dir", "a folder other than the checkpoint (model_dir)", out_dir)
    for inner, outer, what in ((out, model, "inside the checkpoint"), (model, out, "around the checkpoint")):
        if os.path.commonpath([inner, outer]) == outer:
            raise ContractError("out_dir", "a folder outside the checkpoint (model_dir)", f"{out_dir} ({what})")
    if os.path.isdir(out_dir) and not overwrite:
        held = sorted(os.listdir(out_dir))
        if held:
            shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
            raise ContractError("out_dir", "a new or empty folder (overwrite=True, --overwrite: clear what an "
                                "export writes there first)", f"{out_dir} holding {shown}")
    return out_dir


@contextlib.contextmanager
def staged(out_dir: str, *, overwrite: bool):
    """A temporary folder beside `out_dir` to write the export into; moved into `out_dir` when
    the block ends without an exception, removed when it raises (`check_out_dir` came first)."""
    parent, name = os.path.split(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=parent)
    try:
        yield staging
        _install(staging, out_dir, overwrite=overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _install(staging: str, out_dir: str, *, overwrite: bool) -> None:
    """Move the files written into `staging` into `out_dir`, `MODEL_FOLDER` last."""
    if not os.path.exists(out_dir):
        with contextlib.suppress(FileExistsError, OSError):
            os.rename(staging, out_dir)               # the whole folder at once
            return
    os.makedirs(out_dir, exist_ok=True)
    if overwrite:
        for entry in WRITTEN:                         # the model folder first: no stale model loads meanwhile
            _remove(os.path.join(out_dir, entry))
    entries = sorted(os.listdir(staging), key=lambda entry: entry == MODEL_FOLDER)
    for entry in entries:
        os.replace(os.path.join(staging, entry), os.path.join(out_dir, entry))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
