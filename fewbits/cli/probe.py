"""`fewbits probe`: measure this machine and write a device profile for the cost model."""

from __future__ import annotations

import click


@click.command("probe")
@click.option("--model", default="smollm2-135m", show_default=True,
              help="preset or config.json whose decode shapes and depth are measured")
@click.option("-o", "--output", default="device-profile.json", show_default=True, type=click.Path(dir_okay=False),
              help="where to write the profile JSON")
@click.option("--name", default="this-machine", show_default=True, help="profile and device name")
@click.option("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
@click.option("--min-mb", type=float, default=None,
              help="cycle the GEMV passes' weights through copies of this many MB per format (default: the "
                   "model's own footprint, its linears and 16-bit LM head, as a decode step re-reads them)")
@click.option("--device", default="cpu", show_default=True,
              help="what to measure: cpu, or a CUDA device (cuda, cuda:1) for a GPU's profile")
@click.option("--eager", is_flag=True,
              help="measure the per-step costs on the eager decode path (`fewbits bench --eager`) instead of "
                   "the compiled one")
def probe_cmd(model: str, output: str, name: str, threads: int, min_mb: float | None, device: str,
              eager: bool) -> None:
    """Measure memory bandwidth (also over working sets the last-level cache may hold), matmul rates, GEMV per
    format at decode shapes (on a CPU also on the kernels that round the activations to int8, for `fewbits
    bench --activations q8`), KV-cache reads, the per-step overhead, the core-cache refill and (compiled, on a
    CPU) the step's work between its matmuls at the model's widths; write them as a profile that `fewbits plan
    --profile FILE` and `fewbits bench` load.  The per-step costs are those of the
    compiled decode step `fewbits bench` runs (unless --eager); on a CPU its GEMV passes are compiled as the step
    is (a first probe compiles them, ~2 minutes; later ones load them from $FEWBITS_CACHE)."""
    import torch

    from fewbits.bench.probe import build_profile
    from fewbits.cost.profile import save_profile
    from fewbits.files import check_output
    from fewbits.generate import check_device
    from fewbits.models.presets import resolve_model

    if threads:
        torch.set_num_threads(threads)
    try:
        dev = check_device(device)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--device") from None
    spec = resolve_model(model)
    try:
        check_output(output, overwrite=True, kind="file")  # before minutes of measuring
    except OSError as exc:
        raise click.ClickException(str(exc)) from None
    prof = build_profile(spec, name=name, min_bytes=None if min_mb is None else int(min_mb * 2**20),
                         log=click.echo, device=dev, compiled=not eager)
    save_profile(prof, output)
    click.echo(f"wrote {output} ({prof.measured['probe_seconds']:.0f} s of measurement)")
