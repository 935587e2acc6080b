"""`fewbits formats`: the format specs and what each stores per weight."""

from __future__ import annotations

import json

import click

from fewbits.formats.format import EXAMPLE_SPECS, FormatError, parse_format

_KIND = {
    "float": "no quantisation",
    "int": "integer codes",
    "fp8": "OCP 8-bit float codes",
    "fp4": "E2M1 codes",
    "nf4": "NormalFloat-4 codes",
    "mxfp4": "OCP MX: E2M1, E8M0 block scale",
    "mxfp8": "OCP MX: E4M3, E8M0 block scale",
    "nvfp4": "E2M1, E4M3 block scale + FP32 tensor scale",
    "ggml": "llama.cpp block type, as GGUF stores it",
}


@click.command("formats")
@click.argument("specs", nargs=-1)
@click.option("--shape", default="4096x4096", show_default=True,
              help="Weight shape OUTxIN for the exact bits per weight (per-channel scales depend on it).")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def formats(specs: tuple[str, ...], shape: str, as_json: bool) -> None:
    """List format specs with their bits per weight (codes + scales + zero points).

    With SPECS, describe those instead of the built-in list.  Grammar: bf16 | fp16 | fp32 |
    int{2..8}[-t|-g{N}][-asym|-narrow] | fp8-e4m3 | fp8-e5m2 [-t|-g{N}] | fp4-g{N} | nf4-g{N} | mxfp4 | mxfp8 |
    nvfp4, and -s{fp32,fp16,bf16} to change the scale dtype; llama.cpp's q4_0 q4_1 q5_0 q5_1 q8_0 q4_k q5_k q6_k.
    Symmetric integers use the full grid -2^(b-1)..2^(b-1)-1 (the group's extreme on the end code, as GGUF
    Q4_0); -narrow keeps -L..L, L = 2^(b-1)-1.
    """
    try:
        dims = tuple(int(d) for d in shape.lower().split("x"))
        fmts = [parse_format(s) for s in (specs or EXAMPLE_SPECS)]
        rows = [(f, f.bits_per_weight(dims)) for f in fmts]
    except (ValueError, FormatError) as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps([{**f.to_dict(), "bits_per_weight": b, "shape": list(dims)} for f, b in rows], indent=2))
        return
    click.echo(f"{'format':<16} {'bits/weight':>11}  {'scale':<14} stores  (shape {shape})")
    for f, b in rows:
        if f.kind == "float":
            scale = "-"
        elif f.granularity == "group":
            scale = f"{f.scale_dtype}/{f.group_size}"
        else:
            scale = f"{f.scale_dtype}/{f.granularity}"
        click.echo(f"{f.spec:<16} {b:11.4f}  {scale:<14} {_KIND[f.kind]}{_grid(f)}")


def _grid(f) -> str:  # noqa: ANN001
    """Which integer codes a format uses (the grid of symmetric formats, min-max for -asym)."""
    if f.kind != "int":
        return ""
    if not f.symmetric:
        return f" 0..{2**f.bits - 1}, min-max with a zero point"
    if f.grid == "narrow":
        return f" -{f.qmax}..{f.qmax}, absmax scale (narrow grid)"
    return f" {f.qmin}..{f.qmax}, the extreme of either sign on {f.qmin} (full grid)"
