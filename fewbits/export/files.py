"""Writing an output directory or file whole or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_dir(out: Path, write: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Call `write(tmp)` on a fresh directory beside `out`, then rename it to `out`: a failure leaves no
    partial output.  An existing non-empty `out` is replaced only with `overwrite`."""
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp"))
    try:
        write(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_file(out: Path, write: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Call `write(tmp)` on a fresh path beside `out`, then rename it to `out`: a failure leaves no partial
    file.  An existing `out` is replaced only with `overwrite`."""
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
