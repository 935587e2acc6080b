"""`fewbits quantize MODEL --stream`: the streamed path of the quantize command (fewbits.stream), for
checkpoints bigger than memory.  Without --stream/--no-stream the command streams by itself when the
model in its --dtype would take more than half the memory available (`stream.should_stream`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import click

log = logging.getLogger("fewbits.cli")


def model_dir(model: str) -> Path | None:
    """The local folder of MODEL (a packaged name is converted once, then cached); None for a hub id."""
    from fewbits.models.loading import resolve_model
    from fewbits.models.packaged import ensure_converted

    src = resolve_model(model)
    if src.kind == "packaged":
        return ensure_converted(src.name)
    return src.path


def stream_wanted(model: str, dtype: str, flag: bool | None, target: str, budget: str | None) -> bool:
    """--stream as given; without it, True when the model would not fit comfortably in memory and the
    options allow streaming (the fewbits layout, no --budget)."""
    if flag is not None:
        if flag and (target != "fewbits" or budget):
            raise click.UsageError("--stream writes fewbits' own layout without --budget (give --to fewbits, "
                                   "no --budget)")
        if flag and model_dir(model) is None:
            raise click.UsageError(f"--stream needs a model directory or a packaged name, not the hub id {model!r}")
        return flag
    if target != "fewbits" or budget:
        return False
    d = model_dir(model)
    if d is None:
        return False
    from fewbits.stream import AUTO_STREAM_SHARE, should_stream

    if should_stream(d, dtype):
        click.echo(f"{model}: the model in {dtype} takes more than {AUTO_STREAM_SHARE:.0%} of the memory available; "
                   "quantising it block by block from disk (--no-stream to load it whole)", err=True)
        return True
    return False


def quantize_streamed_cmd(model: str, recipe: Any, out: str, dtype: str, calib_files: list[Path] | None,
                          calib_windows: int, calib_seq_len: int, overwrite: bool, quiet: bool) -> tuple[Any, Path]:
    """Quantise MODEL block by block into OUT; returns (report, OUT)."""
    import transformers

    from fewbits import api
    from fewbits.models.loading import refuse_remote_code

    d = model_dir(model)
    assert d is not None
    tok = None
    if any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        refuse_remote_code(d)
        tok = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True, trust_remote_code=False)
    data = None
    if any(api.METHODS[r.method].needs_data for r in recipe.rules if r.method in api.METHODS):
        if tok is None:
            raise click.ClickException(f"{d} has no tokenizer, so no calibration text can be made for a calibrated "
                                       "method")
        data = api.calibration_data(tok, files=calib_files, samples=calib_windows, seq_len=calib_seq_len)
    report = api.quantize_streamed(d, recipe, out, data=data, tokenizer=tok, dtype=dtype, progress=not quiet,
                                   overwrite=overwrite, source=model)
    return report, Path(out)
