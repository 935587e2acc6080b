"""The manifest of a fewbits output folder: size and sha256 of every file, written last (`fewbits.files`
writes it), checked on load.  A folder without it, or whose files do not match it, is not whole."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST = "fewbits-manifest.json"
MANIFEST_FORMAT = "fewbits-output"
MANIFEST_VERSION = 1
#: metadata files of fewbits outputs written before manifests existed (a saved model, a converted cache entry)
LEGACY_MARKERS = ("fewbits.json", "fewbits_source.json")


class IntegrityError(ValueError):
    """A fewbits output folder does not match its manifest (truncated, damaged or edited)."""


# ---------------------------------------------------------------------- recognising fewbits' outputs
def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of `folder`, None if it has none; IntegrityError if it is not a fewbits manifest."""
    mf = Path(folder) / MANIFEST
    if not mf.is_file():
        return None
    try:
        data = json.loads(mf.read_bytes())
    except (ValueError, RecursionError, OSError) as e:
        raise IntegrityError(f"{mf}: unreadable manifest ({type(e).__name__})") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or data.get("version") != MANIFEST_VERSION:
        raise IntegrityError(f"{mf}: not a fewbits manifest version {MANIFEST_VERSION}")
    files = data.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("bytes"), int)
            and isinstance(v.get("sha256"), str) for k, v in files.items()):
        raise IntegrityError(f"{mf}: the file list is malformed")
    for rel in files:
        parts = Path(rel).parts
        if not parts or Path(rel).is_absolute() or ".." in parts or rel == MANIFEST:
            raise IntegrityError(f"{mf}: names a file outside the folder ({rel!r})")
    return data


def is_fewbits_output(path: Path) -> bool:
    """True for a real folder (not a symlink) holding a fewbits manifest or an older fewbits metadata file."""
    p = Path(path)
    if p.is_symlink() or not p.is_dir():
        return False
    try:
        if read_manifest(p) is not None:
            return True
    except IntegrityError:
        return True  # fewbits' name, damaged: still fewbits' own output to replace
    return any((p / m).is_file() and not (p / m).is_symlink() for m in LEGACY_MARKERS)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify_dir(folder: str | os.PathLike[str], full: bool = True, required: bool = False) -> dict[str, Any] | None:
    """Check every file the manifest lists: present, its size, and (full) its sha256.  Returns the manifest,
    None for a folder written before manifests (or IntegrityError with `required`)."""
    d = Path(folder)
    man = read_manifest(d)
    if man is None:
        if required:
            raise IntegrityError(f"{d}: no {MANIFEST}; the folder was not completed by fewbits")
        return None
    for rel, info in man["files"].items():
        f = d / rel
        if not f.is_file():
            raise IntegrityError(f"{f}: listed in the manifest but missing")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise IntegrityError(f"{f}: {size} bytes, the manifest says {info['bytes']} (truncated or replaced)")
        if full and _sha256(f) != info["sha256"]:
            raise IntegrityError(f"{f}: sha256 differs from the manifest (the file is damaged or was edited)")
    return man


def finish_dir(tmp: Path, kind: str) -> None:
    """Modes from the umask, every file flushed, then the manifest last."""
    umask = os.umask(0)
    os.umask(umask)
    files: dict[str, dict[str, Any]] = {}
    for root, dirs, names in os.walk(tmp):
        os.chmod(root, 0o777 & ~umask)
        for n in sorted(names):
            p = Path(root) / n
            if p.is_symlink():
                raise IntegrityError(f"{p}: a symlink inside an output; fewbits writes plain files only")
            os.chmod(p, 0o666 & ~umask)
            with p.open("rb") as f:
                os.fsync(f.fileno())
            files[p.relative_to(tmp).as_posix()] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        dirs.sort()
    man = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "kind": kind, "files": files}
    mp = tmp / MANIFEST
    with open(mp, "w") as f:
        f.write(json.dumps(man, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.chmod(mp, 0o666 & ~umask)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
