"""`fewbits try`: 64 weights, one quantiser, every stored value on screen (fewbits/eval/playground.py)."""

from __future__ import annotations

import json

import click

from fewbits.eval.playground import FAMILIES


@click.command("try")
@click.option("--family", type=click.Choice(list(FAMILIES)), default="int", show_default=True,
              help="Format family: integer codes (sym, or --asym), fp8, fp4 (E2M1), nf4, or the MX/NV blocks.")
@click.option("--bits", type=click.IntRange(2, 8), default=4, show_default=True, help="Bits per code (int only).")
@click.option("--group", type=click.Choice(["64", "32", "16", "8"]), default="64", show_default=True,
              help="Weights sharing one scale (64 = one scale for all; the MX/NV blocks fix their own).")
@click.option("--outlier", is_flag=True, help="Make weight 5 an outlier (0.16, about 5x the largest).")
@click.option("--asym", is_flag=True, help="Min-max with a zero point instead of symmetric absmax (int only).")
@click.option("--full-grid", is_flag=True,
              help="Symmetric codes -2^(b-1)..2^(b-1)-1 (the extreme on the end code) instead of -L..L.")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True,
              help="numpy default_rng seed of the 64 weights (a non-negative integer).")
@click.option("--json", "as_json", is_flag=True, help="Print every stored value as JSON.")
def try_cmd(family: str, bits: int, group: str, outlier: bool, asym: bool, full_grid: bool, seed: int,
            as_json: bool) -> None:
    """Quantise 64 weights ~ N(0, 0.02) and show each original and stored value.

    Prints the error, how many weights became zero, and the bits per weight including fp16 scales.
    Try --bits 4, then --outlier, then --group 16 and 8, then --bits 3 and 2 with --group 8.
    """
    from fewbits.eval.playground import format_try_text, playground_spec, try_quantiser
    from fewbits.formats.format import FormatError

    try:
        r = try_quantiser(playground_spec(family, bits, int(group), asym, full_grid), seed=seed, outlier=outlier)
    except (ValueError, FormatError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(r.to_dict(), indent=2) if as_json else format_try_text(r, outlier))
