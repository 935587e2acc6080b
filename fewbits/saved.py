"""What a saved quantised model folder must hold before anything is built from it: the manifest's
checksums, a well-formed `fewbits.json`, finite numbers.  `fewbits.api` saves and loads; this file says
what is refused and why, one line naming the file, field or tensor at fault."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from fewbits.files import IntegrityError, verify_dir

log = logging.getLogger("fewbits.api")

SAVED_FORMAT = "fewbits-quantized-model"
#: 2: "layers" describes every replaced layer (kind + parameters, see models.qlinear.LAYER_KINDS);
#: 1: "quantized_layers" held only QuantLinear weight metadata (still read)
SAVED_VERSION = 2
READABLE_VERSIONS = (1, 2)
WEIGHTS_FILE = "model.safetensors"
META_FILE = "fewbits.json"
#: dtypes a saved model is built in (fewbits.json "dtype")
SAVED_DTYPES = ("float32", "bfloat16", "float16")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


class SavedModelError(ValueError):
    """A saved quantised model directory that cannot be read (missing, corrupt or altered files)."""


def check_integrity(d: Path) -> dict[str, Any] | None:
    """The folder against its manifest (sizes and sha256); a folder saved before manifests is read unchecked."""
    try:
        man = verify_dir(d)
    except IntegrityError as e:
        raise SavedModelError(str(e)) from None
    if man is None:
        log.warning("%s: saved before fewbits wrote manifests; its files are not checked against checksums", d)
    return man


def read_saved_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """fewbits.json of a saved model directory, checked for format, version and the type of every field
    the loader uses; a version-1 file's "quantized_layers" (packed weights only) is read as version 2's
    "layers" of kind "quant_linear"."""
    d = Path(path)
    if not d.is_dir():
        raise SavedModelError(f"{d}: no such directory")
    mf = d / META_FILE
    if not mf.is_file():
        raise SavedModelError(f"{d}: {META_FILE} is missing; not a model saved by fewbits")
    try:
        meta = json.loads(mf.read_bytes())
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SavedModelError(f"{mf}: corrupt metadata ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(meta, dict) or meta.get("format") != SAVED_FORMAT or meta.get("version") not in READABLE_VERSIONS:
        got = "not an object" if not isinstance(meta, dict) else \
            f"format {repr(meta.get('format'))[:60]} version {repr(meta.get('version'))[:20]}"
        raise SavedModelError(f"{mf}: {got} is not {SAVED_FORMAT!r} version "
                              f"{' or '.join(map(str, READABLE_VERSIONS))}")
    if meta["version"] == 1 and isinstance(meta.get("quantized_layers"), dict):
        meta["layers"] = {n: {"kind": "quant_linear", "qweight": q} for n, q in meta.pop("quantized_layers").items()}
    layers = meta.get("layers")
    if not isinstance(layers, dict):
        raise SavedModelError(f"{mf}: the layer descriptions (\"layers\") are missing")
    bad = next((n for n, v in layers.items() if not isinstance(v, dict)), None)
    if bad is not None:
        raise SavedModelError(f"{mf}: layer {bad[:80]!r} is described by a {type(layers[bad]).__name__}, not an object")
    cls = meta.get("model_class")
    if not isinstance(cls, str) or not _IDENT.fullmatch(cls):
        raise SavedModelError(f"{mf}: \"model_class\" must name a transformers model class, got {str(cls)[:60]!r}")
    if meta.get("dtype") not in SAVED_DTYPES:
        raise SavedModelError(f"{mf}: \"dtype\" must be one of {', '.join(SAVED_DTYPES)}, "
                              f"got {str(meta.get('dtype'))[:40]!r}")
    tied = meta.get("tied") or {}
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise SavedModelError(f"{mf}: \"tied\" must map parameter names to parameter names")
    meta["tied"] = tied
    for key, types in (("recipe", (dict,)), ("source", (str, type(None))), ("report", (dict, type(None)))):
        if key in meta and not isinstance(meta[key], types):
            raise SavedModelError(f"{mf}: \"{key}\" has the wrong type ({type(meta[key]).__name__})")
    return meta


def check_finite(tensors: dict[str, Any], wf: Path) -> None:
    """Every floating tensor of the file finite (a NaN norm weight or scale would give NaN logits silently)."""
    from fewbits.formats.quant import all_finite

    for k, t in tensors.items():
        if t.is_floating_point() and not all_finite(t):
            raise SavedModelError(f"{wf}: tensor {k} holds NaN or inf values; the file is damaged")


__all__ = ["SAVED_FORMAT", "SAVED_VERSION", "READABLE_VERSIONS", "WEIGHTS_FILE", "META_FILE", "SavedModelError",
           "read_saved_meta", "check_integrity", "check_finite"]
