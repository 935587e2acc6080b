"""`fewbits layer-error`: quantise one linear layer several ways and print how far its output moves."""

from __future__ import annotations

import json
import math

import click

from fewbits.formats.format import FormatError, parse_format

#: largest W a run may draw (rows x cols): 2^24 values, 128 MiB in float64, about a second per format
MAX_ELEMENTS = 1 << 24


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not math.isfinite(value):
        raise click.BadParameter(f"must be a finite number, got {value}")
    return value


def _specs(value: str) -> tuple[str, ...]:
    specs = tuple(s.strip() for s in value.split(",") if s.strip())
    for s in specs:
        try:
            parse_format(s)
        except FormatError as e:
            raise click.BadParameter(str(e)) from e
    return specs


@click.command("layer-error")
@click.option("--weights", default="int8,int4,int4-g128,int4-g32,int3-g128", show_default=True,
              help="Comma-separated weight format specs (any spec of `fewbits formats`).")
@click.option("--rows", type=click.IntRange(1), default=512, show_default=True, help="Output features of W.")
@click.option("--cols", type=click.IntRange(1), default=512, show_default=True,
              help="Input features of W (length of x).")
@click.option("--w-std", type=click.FloatRange(min=0, min_open=True), callback=_finite, default=0.02,
              show_default=True, help="Standard deviation of the weights.")
@click.option("--outlier-channel", type=click.IntRange(0), default=7, show_default=True,
              help="Channel of x set to --outlier-value.")
@click.option("--outlier-value", callback=_finite, default=20.0, show_default=True,
              help="Value of the outlier channel.")
@click.option("--no-outlier", is_flag=True, help="Leave the outlier token equal to the normal one.")
@click.option("--threshold", type=click.FloatRange(min=0), callback=_finite, default=6.0, show_default=True,
              help="LLM.int8()-style split: activation channels with |x| above this stay in 16-bit.")
@click.option("--scales", "scale_dtype", default="fp64", show_default=True,
              type=click.Choice(["fp64", "fp32", "fp16", "bf16"]),
              help="Precision the scales are kept in (fp64: exact, as the textbook formula).")
@click.option("--grid", default="narrow", show_default=True, type=click.Choice(["narrow", "full", "spec"]),
              help="Grid of symmetric integers: narrow -L..L (the textbook absmax), full -2^(b-1)..2^(b-1)-1, "
                   "or spec (each format's own).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True,
              help="numpy default_rng seed (W drawn first, then x).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def layer_error(weights: str, rows: int, cols: int, w_std: float, outlier_channel: int, outlier_value: float,
                no_outlier: bool, threshold: float, scale_dtype: str, grid: str, seed: int, as_json: bool) -> None:
    """Quantise one linear layer y = W x and measure how far y moves from the exact answer.

    Weight-only rows quantise W and keep x exact; W8A8 rows quantise W per output channel and x per token,
    for a normal token, a token with one outlier channel, and with the outlier channels kept in 16-bit.
    """
    from fewbits.eval.layer_error import experiment

    specs = _specs(weights)
    if rows * cols > MAX_ELEMENTS:
        raise click.BadParameter(f"W of {rows} x {cols} = {rows * cols:,} values is more than this demonstration "
                                 f"draws ({MAX_ELEMENTS:,}); use smaller --rows/--cols", param_hint="--rows/--cols")
    try:
        result = experiment(specs, rows, cols, w_std, None if no_outlier else outlier_channel, outlier_value, seed,
                            threshold, scale_dtype, None if grid == "spec" else grid)
    except (ValueError, FormatError) as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"y = W x with W {rows}x{cols} ~ N(0, {w_std:g}), x ~ N(0, 1), seed {seed}; "
               f"relative error ||y - y_ref|| / ||y_ref||, scales in {scale_dtype}, symmetric integers on the "
               + {"narrow": "narrow grid -L..L", "full": "full grid -2^(b-1)..2^(b-1)-1",
                  "spec": "grid each format names"}[grid])
    click.echo("\nweight-only (activations stay 16-bit)")
    for r in result["weight-only"]:
        click.echo(f"  {r['name']:<18} {r['bits_per_weight']:6.3f} bits/weight   error {r['rel_error']:6.2%}")
    click.echo("\nweights and activations in 8-bit (weights per channel, activations one scale per token)")
    for r in result["w8a8"]:
        click.echo(f"  {r['name']:<34} error {r['rel_error']:6.2%}")
