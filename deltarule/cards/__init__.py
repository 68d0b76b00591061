"""WebGPU kernel cards of deltarule's WGSL shaders (`deltarule card export DIR`).

A card is a folder a JavaScript loader (web/deltarule-kernels.js) runs from:

- ``manifest.json``: the op contract (bind keys, dtypes, ranks, presence
  rules, attributes with defaults; `manifests.py`);
- ``metadata.json``: id, the variants (which template each dispatch renders),
  the host program, provenance, and the sha256 digest of every other file;
- ``test.json`` / ``bench.json``: correctness cases with expected outputs from
  the float64 reference, and benchmark shapes (`fixtures.py`);
- the ``*.wgsl.jinja`` templates (deltarule's own, rendered by the loader with
  Nunjucks) and ``host.js`` + ``common.js``: the host program that checks
  shapes, builds the sequence table and plans the dispatches.

Three cards: ``com.microsoft.GatedDeltaNet`` and
``com.microsoft.LinearAttentionGate`` (exactly ONNX Runtime's contracts) and
``deltarule.LinearAttention`` (the generalized op: per-key decay, erase /
write gates, state slabs with row indices and speculative rows).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from importlib import resources

from ..errors import ContractError
from ..tools.paths import writable_folder
from . import fixtures, manifests

__all__ = ["export", "CARDS"]

_WGSL = resources.files("deltarule.kernels.wgsl")

# The variants a call may ask for (`variant`; "auto" lets the host program choose) and the
# templates each renders; every card also has narrow.wgsl.jinja for 16-bit outputs.
_RECURRENT = {"name": "recurrent", "templates": ["recurrent.wgsl.jinja"],
              "use": "decode, speculative verify and short sequences: one workgroup per (value tile, head, "
                     "sequence), the state tile in registers"}
_CHUNKED = {"name": "chunked", "templates": ["chunked_intra.wgsl.jinja", "chunked_state.wgsl.jinja"],
            "use": "prefill (chosen by \"auto\" for sequences of 128 tokens or more; not for speculative rows): "
                   "the WY / UT chunked form, per chunk the state-free part, then the chunks of each "
                   "sequence in order with the state tile in workgroup memory"}
_HELPERS = ["_common.wgsl.jinja", "narrow.wgsl.jinja"]
_JS = resources.files(__package__).joinpath("js")

# card id -> (manifest, host program, variants, test cases)
CARDS = {
    "com.microsoft.GatedDeltaNet": (
        manifests.GATED_DELTA_NET, "gated_delta_net.js",
        [_RECURRENT, _CHUNKED],
        fixtures.gated_delta_net_tests),
    "com.microsoft.LinearAttentionGate": (
        manifests.LINEAR_ATTENTION_GATE, "linear_attention_gate.js",
        [{"name": "gate", "templates": ["gate.wgsl.jinja"], "use": "every call: one invocation per element"}],
        fixtures.linear_attention_gate_tests),
    "deltarule.LinearAttention": (
        manifests.LINEAR_ATTENTION, "linear_attention.js",
        [_RECURRENT, _CHUNKED],
        fixtures.linear_attention_tests),
}
_SHARED_JS = ("common.js",)


def _templates(variants) -> list[str]:
    """The variants' templates, the templates they import and the narrowing pass."""
    return sorted({t for v in variants for t in v["templates"]} | set(_HELPERS))


def export(directory: str, only: list[str] | None = None) -> list[str]:
    """Write one card folder per op under `directory` (replacing what is there); returns their paths.

    Args:
        directory: the parent folder (created if missing); each card's folder is named by its id.
        only: card ids to write (default: every card of `CARDS`).

    Raises:
        deltarule.ContractError: before anything is written, where `directory` cannot be
            written (an existing file, a path under a file, not writable:
            `deltarule.tools.paths.writable_folder`), a card's folder in it is a file or a link, or
            `only` names an unknown card.

    Example:
        >>> import os, tempfile
        >>> import deltarule.cards
        >>> [path] = deltarule.cards.export(tempfile.mkdtemp(), only=["com.microsoft.LinearAttentionGate"])
        >>> sorted(os.listdir(path))        # doctest: +NORMALIZE_WHITESPACE
        ['README.md', '_common.wgsl.jinja', 'bench.json', 'common.js', 'gate.wgsl.jinja', 'host.js',
         'manifest.json', 'metadata.json', 'narrow.wgsl.jinja', 'test.json']
    """
    directory = writable_folder("directory", directory)
    unknown = sorted(set(only or ()) - set(CARDS))
    if unknown:
        raise ContractError("only", f"card ids of {', '.join(CARDS)}", repr(unknown[0]))
    chosen = [card_id for card_id in CARDS if not only or card_id in only]
    for card_id in chosen:
        folder = os.path.join(directory, card_id)
        if os.path.islink(folder) or (os.path.lexists(folder) and not os.path.isdir(folder)):
            raise ContractError("directory", f"a folder whose {card_id} entry, if any, is a folder (it is replaced)",
                                f"{directory!r}, where {card_id} is {'a link' if os.path.islink(folder) else 'a file'}")
    written = []
    for card_id in chosen:
        manifest, host, variants, tests = CARDS[card_id]
        folder = os.path.join(directory, card_id)
        files = {
            "manifest.json": _json(manifest),
            "test.json": _json({"cases": tests()}, indent=None),
            "bench.json": _json({"cases": fixtures.bench_cases(card_id)}),
        }
        for name in _templates(variants):
            files[name] = _WGSL.joinpath(name).read_text()
        files["host.js"] = _JS.joinpath(host).read_text()
        for name in _SHARED_JS:
            files[name] = _JS.joinpath(name).read_text()
        files["README.md"] = _readme(manifest, variants)
        metadata = {
            "id": card_id,
            "version": 1,
            "host": "host.js",
            "modules": list(_SHARED_JS),
            "variants": variants,
            "templates": _templates(variants),
            "template_engine": "jinja (rendered by Nunjucks in JavaScript, jinja2 in Python)",
            "provenance": {"generator": "deltarule card export", "package": "deltarule",
                           "version": _version(), "shaders": "deltarule/kernels/wgsl",
                           "expected_outputs": "deltarule.reference (float64)"},
            "digests": {name: "sha256:" + hashlib.sha256(text.encode()).hexdigest()
                        for name, text in sorted(files.items())},
        }
        files["metadata.json"] = _json(metadata)
        try:        # only the writes: a package file that cannot be read above is a broken install
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            for name, text in files.items():
                with open(os.path.join(folder, name), "w") as f:
                    f.write(text)
        except OSError as e:        # checked up front; still possible (a read-only or full file system)
            raise ContractError("directory", "a writable folder",
                                f"{directory!r} (writing {e.filename or folder!r}: {e.strerror or e})") from e
        written.append(folder)
    return written


def _json(data, indent=1) -> str:
    return json.dumps(data, indent=indent, allow_nan=False) + "\n"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("deltarule")
    except PackageNotFoundError:
        return "unknown"


def _readme(manifest: dict, variants: list[dict]) -> str:
    def presence(p):
        if isinstance(p, str):
            return p
        if "exactly_when" in p:
            return "exactly when " + "; ".join(f"{a} in {v}" for a, v in p["exactly_when"].items())
        if "with" in p:
            return "optional, with " + ", ".join(p["with"])
        return "optional, " + "; ".join(f"{b} of rank {r}" for b, r in p["requires_rank"].items())

    lines = [f"# {manifest['id']}", "", manifest["description"], "", "## Inputs", "",
             "| Bind key | Name | Type | Rank | Presence | Description |", "| --- | --- | --- | --- | --- | --- |"]
    for x in manifest["inputs"]:
        lines.append(f"| `{x['bind']}` | `{x['name']}` | `{x['type']}` | {x.get('rank', '—')} | "
                     f"{presence(x['presence'])} | {x.get('description', '')} |")
    lines += ["", "## Outputs", "", "| Bind key | Name | Type | Rank | Presence | Description |",
              "| --- | --- | --- | --- | --- | --- |"]
    for x in manifest["outputs"]:
        lines.append(f"| `{x['bind']}` | `{x['name']}` | `{x['type']}` | {x.get('rank', '—')} | "
                     f"{presence(x['presence'])} | {x.get('description', '')} |")
    lines += ["", "## Attributes", "", "| Attribute | Default | Values | Description |", "| --- | --- | --- | --- |"]
    for a in manifest["attributes"]:
        lines.append(f"| `{a['name']}` | `{json.dumps(a['default'])}` | {a.get('values', '')} | "
                     f"{a.get('description', '')} |")
    lines += ["", "## Type constraints", "", "| Variable | Allowed dtypes |", "| --- | --- |"]
    lines += [f"| `{k}` | {', '.join(v)} |" for k, v in manifest["type_constraints"].items()]
    lines += ["", "## Variants", ""] + [f"- `{v['name']}` ({', '.join(v['templates'])}): {v['use']}"
                                        for v in variants]
    lines += ["", "## Use", "", "```js", 'import { loadKernel } from "./deltarule-kernels.js";',
              f'const kernel = await loadKernel("cards/{manifest["id"]}");',
              "const outputs = await kernel({ /* bind key: { data, shape } */ });", "```", "",
              "Generated by `deltarule card export`; see deltarule's docs/web.md.", ""]
    return "\n".join(lines)
