"""Output paths checked before the work that writes them.

A command that writes a file or a folder at the end of a long run (``deltarule
bench --json``, ``--plot``, ``deltarule card export DIR``, ``deltarule export onnx
... OUT_DIR``) checks the path first, so a typo costs a one-line error instead of
the results. Both checks raise `deltarule.ContractError` naming the option, and
return the path unchanged (as a ``str``) when it can be written.

They check what can be known up front (the folders on the way, the kind of what is
already there, write permission for a user that is not root); a write can still
fail later (a full disk): the writer reports that itself.
"""

from __future__ import annotations

import os

from ..errors import ContractError

__all__ = ["writable_file", "writable_folder"]


def writable_file(option: str, path: str | os.PathLike) -> str:
    """`path` as a ``str`` if a file can be written there, else raise `ContractError`.

    Writable means: the path is not empty and does not end in a path separator; it
    is not an existing folder (nor a link to one); its parent folder exists and is a
    folder (not a file); and the file, if it exists, or else the parent folder, is
    writable by this process. An existing file is allowed: the writer replaces it.

    Args:
        option: what the message names, e.g. ``"--json"``.
        path: the file to be written.

    Raises:
        deltarule.ContractError: ``"<option>: expected a writable file path, got '<path>' (why)"``.

    Example:
        >>> import tempfile
        >>> from deltarule.tools.paths import writable_file
        >>> folder = tempfile.mkdtemp()
        >>> writable_file("--json", folder + "/results.json") == folder + "/results.json"
        True
        >>> writable_file("--json", folder)      # doctest: +ELLIPSIS
        Traceback (most recent call last):
        deltarule.errors.ContractError: --json: expected a writable file path, got '...' (an existing folder)
    """
    text = _text(option, "a writable file path", path)

    def fail(why: str) -> ContractError:
        return ContractError(option, "a writable file path", f"{text!r} ({why})")

    if text.endswith(os.sep) or (os.altsep and text.endswith(os.altsep)):
        raise fail("ends in a path separator: a folder, not a file")
    if os.path.isdir(text):
        raise fail("an existing folder")
    parent = os.path.dirname(os.path.abspath(text))
    blocked = _blocking_file(parent)
    if blocked is not None:
        raise fail(f"{blocked!r} is a file, not a folder")
    if not os.path.isdir(parent):
        raise fail(f"no folder {parent!r}")
    if os.path.lexists(text):
        if os.path.exists(text) and not os.access(text, os.W_OK):
            raise fail("the file is not writable")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise fail(f"the folder {parent!r} is not writable")
    return text


def writable_folder(option: str, path: str | os.PathLike) -> str:
    """`path` as a ``str`` if a folder can be written there (made if missing), else raise
    `ContractError`.

    Writable means: the path is not empty; it is not an existing file (an existing
    folder, or a link to one, is fine); its nearest existing ancestor is a folder, not
    a file (so ``makedirs`` can make the rest); and that folder is writable by this
    process. Nothing is created.

    Args:
        option: what the message names, e.g. ``"DIR"`` or ``"OUT_DIR"``.
        path: the folder to be written into.

    Raises:
        deltarule.ContractError: ``"<option>: expected a writable folder, got '<path>' (why)"``.

    Example:
        >>> import os, tempfile
        >>> from deltarule.tools.paths import writable_folder
        >>> folder = tempfile.mkdtemp()
        >>> writable_folder("DIR", os.path.join(folder, "new", "cards")) == os.path.join(folder, "new", "cards")
        True
        >>> open(os.path.join(folder, "notes.txt"), "w").close()
        >>> writable_folder("DIR", os.path.join(folder, "notes.txt", "cards"))    # doctest: +ELLIPSIS
        Traceback (most recent call last):
        deltarule.errors.ContractError: DIR: expected a writable folder, got '...' ('...' is a file, not a folder)
    """
    text = _text(option, "a writable folder", path)

    def fail(why: str) -> ContractError:
        return ContractError(option, "a writable folder", f"{text!r} ({why})")

    absolute = os.path.abspath(text)
    blocked = _blocking_file(absolute)
    if blocked is not None:
        raise fail("an existing file, not a folder" if blocked == absolute else f"{blocked!r} is a file, not a folder")
    existing = _nearest_existing(absolute)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise fail(f"the folder {existing!r} is not writable")
    return text


def _text(option: str, expected: str, path) -> str:
    try:
        text = os.fspath(path)
    except TypeError:
        raise ContractError(option, expected, f"{type(path).__name__} {path!r}") from None
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text:
        raise ContractError(option, expected, "'' (an empty path)")
    if "\0" in text:
        raise ContractError(option, expected, f"{text!r} (contains a NUL character)")
    return text


def _nearest_existing(absolute: str) -> str:
    """The path itself or its nearest ancestor that exists (following links)."""
    current = absolute
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def _blocking_file(absolute: str) -> str | None:
    """The nearest existing ancestor of `absolute` (or itself) if it is not a folder; None
    where it is one. A dangling link counts as existing: nothing can be made through it."""
    current = absolute
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent
    return None if os.path.isdir(current) else current
