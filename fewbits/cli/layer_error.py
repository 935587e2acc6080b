"""`fewbits layer-error`: quantise one linear layer several ways and print how far its output moves."""

from __future__ import annotations

import json

import click

from fewbits.formats.format import FormatError, parse_format


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
@click.option("--rows", default=512, show_default=True, help="Output features of W.")
@click.option("--cols", default=512, show_default=True, help="Input features of W (length of x).")
@click.option("--w-std", default=0.02, show_default=True, help="Standard deviation of the weights.")
@click.option("--outlier-channel", default=7, show_default=True, help="Channel of x set to --outlier-value.")
@click.option("--outlier-value", default=20.0, show_default=True, help="Value of the outlier channel.")
@click.option("--no-outlier", is_flag=True, help="Leave the outlier token equal to the normal one.")
@click.option("--threshold", default=6.0, show_default=True,
              help="LLM.int8()-style split: activation channels with |x| above this stay in 16-bit.")
@click.option("--scales", "scale_dtype", default="fp64", show_default=True,
              type=click.Choice(["fp64", "fp32", "fp16", "bf16"]),
              help="Precision the scales are kept in (fp64: exact, as the textbook formula).")
@click.option("--grid", default="narrow", show_default=True, type=click.Choice(["narrow", "full", "spec"]),
              help="Grid of symmetric integers: narrow -L..L (the textbook absmax), full -2^(b-1)..2^(b-1)-1, "
                   "or spec (each format's own).")
@click.option("--seed", default=0, show_default=True, help="numpy default_rng seed (W drawn first, then x).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def layer_error(weights: str, rows: int, cols: int, w_std: float, outlier_channel: int, outlier_value: float,
                no_outlier: bool, threshold: float, scale_dtype: str, grid: str, seed: int, as_json: bool) -> None:
    """Quantise one linear layer y = W x and measure how far y moves from the exact answer.

    Weight-only rows quantise W and keep x exact; W8A8 rows quantise W per output channel and x per token,
    for a normal token, a token with one outlier channel, and with the outlier channels kept in 16-bit.
    """
    from fewbits.eval.layer_error import make_case, run

    specs = _specs(weights)
    try:
        case = make_case(rows, cols, w_std, None if no_outlier else outlier_channel, outlier_value, seed)
        for s in specs:
            parse_format(s).check_shape((rows, cols), "W")
        result = run(case, specs, threshold, scale_dtype, None if grid == "spec" else grid)
    except (ValueError, FormatError) as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps({k: [{"name": n, "bits_per_weight": b, "rel_error": e} for n, b, e in v]
                               for k, v in result.items()}, indent=2))
        return
    click.echo(f"y = W x with W {rows}x{cols} ~ N(0, {w_std:g}), x ~ N(0, 1), seed {seed}; "
               f"relative error ||y - y_ref|| / ||y_ref||, scales in {scale_dtype}, symmetric integers on the "
               + {"narrow": "narrow grid -L..L", "full": "full grid -2^(b-1)..2^(b-1)-1",
                  "spec": "grid each format names"}[grid])
    click.echo("\nweight-only (activations stay 16-bit)")
    for name, bpw, err in result["weight-only"]:
        click.echo(f"  {name:<18} {bpw:6.3f} bits/weight   error {err:6.2%}")
    click.echo("\nweights and activations in 8-bit (weights per channel, activations one scale per token)")
    for name, _, err in result["w8a8"]:
        click.echo(f"  {name:<34} error {err:6.2%}")
