"""`fewbits try`: 64 weights, one quantiser, every stored value on screen."""

from __future__ import annotations

import click


@click.command("try")
@click.option("--bits", type=click.IntRange(2, 8), default=4, show_default=True, help="Bits per code.")
@click.option("--group", type=click.Choice(["64", "32", "16", "8"]), default="64", show_default=True,
              help="Weights sharing one scale (64 = one scale for all).")
@click.option("--outlier", is_flag=True, help="Make weight 5 an outlier (0.16, about 5x the largest).")
@click.option("--asym", is_flag=True, help="Min-max with a zero point instead of symmetric absmax.")
@click.option("--full-grid", is_flag=True,
              help="Symmetric codes -2^(b-1)..2^(b-1)-1 (the extreme on the end code) instead of -L..L.")
@click.option("--seed", default=0, show_default=True, help="numpy default_rng seed of the 64 weights.")
def try_cmd(bits: int, group: str, outlier: bool, asym: bool, full_grid: bool, seed: int) -> None:
    """Quantise 64 weights ~ N(0, 0.02) and show each original and stored value.

    Prints the error, how many weights became zero, and the bits per weight including fp16 scales.
    Try --bits 4, then --outlier, then --group 16 and 8, then --bits 3 and 2 with --group 8.
    """
    import numpy as np
    import torch

    from fewbits.tensor import quantize_tensor

    w = np.random.default_rng(seed).normal(0, 0.02, 64)
    if outlier:
        w[5] = 0.16
    # symmetric codes default to the textbook absmax grid -L..L of the reference documents
    grid = "-asym" if asym else "" if full_grid else "-narrow"
    spec = f"int{bits}" + ("" if group == "64" else f"-g{group}") + grid
    x = torch.from_numpy(w).float().reshape(1, 64)
    qt = quantize_tensor(x, spec, "weights")
    hat = qt.dequantize().reshape(64).double().numpy()
    codes = qt.unpacked_codes().reshape(64).tolist()
    scales = qt.scale_values().reshape(-1).tolist()
    err = np.abs(hat - w)
    zeros = int(((hat == 0) & (w != 0)).sum())
    click.echo(f"format {qt.fmt.spec}: {len(scales)} scale(s) of {64 // len(scales)} weights, "
               f"scale{'s' if len(scales) > 1 else ''} " + ", ".join(f"{s:.5f}" for s in scales))
    click.echo(f"{'#':>3} {'original':>9} {'code':>5} {'stored':>9} {'error':>8}")
    for i in range(64):
        mark = "  <- zero" if hat[i] == 0 and w[i] != 0 else ("  <- outlier" if outlier and i == 5 else "")
        click.echo(f"{i:3d} {w[i]:9.5f} {codes[i]:5d} {hat[i]:9.5f} {err[i]:8.5f}{mark}")
    rel = float(np.linalg.norm(hat - w) / np.linalg.norm(w))
    click.echo(f"\nrelative error {rel:.2%}, max error {err.max():.5f}, {zeros} of 64 weights became zero")
    click.echo(f"bits per weight: {qt.fmt.bits_per_weight((1, 64)):.3f} ({bits} per code + scales"
               f"{' + zero points' if asym else ''}); {qt.nbytes} bytes stored vs 128 in bf16")
