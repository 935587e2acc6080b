"""`fewbits plan`: predict decode speed and memory of a model on a device in given formats.

Pure Python + numpy on its default path (matplotlib only for --plot); never imports torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from fewbits.cost.plan import PlanResult, format_breakdown
from fewbits.cost.report import DEFAULT_SWEEP, plan_report
from fewbits.formats.format import MISFIT_POLICIES


def _parse_axes(axes: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    out = dict(DEFAULT_SWEEP)
    for item in axes:
        name, sep, values = item.partition("=")
        if not sep or name not in DEFAULT_SWEEP:
            raise click.BadParameter(f"{item!r}: write batch=1,8,32 or context=1024,4096", param_hint="--sweep")
        try:
            nums = tuple(int(v) for v in values.split(",") if v.strip())
        except ValueError:
            raise click.BadParameter(f"{item!r}: values must be integers", param_hint="--sweep") from None
        if not nums or min(nums) <= 0:
            raise click.BadParameter(f"{item!r}: values must be positive integers", param_hint="--sweep")
        out[name] = nums
    return out


def _csv(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(v.strip() for v in value.split(",") if v.strip())


@click.command("plan")
@click.option("--model", "-m", default="llama-3-8b", show_default=True,
              help="Preset name (e.g. llama-3-70b, smollm2-135m) or a path to a config.json.")
@click.option("--device", "-d", default=None, help="Device (h100, h200, a100, b200, mi300x, l40s, l4, rtx4090, "
              "cpu, ...); default: the profile's device, else h100.")
@click.option("--batch", "-b", type=int, default=1, show_default=True, help="Sequences decoded together.")
@click.option("--context", "-c", type=int, default=2048, show_default=True, help="Cached tokens per sequence.")
@click.option("--weights", "-w", default="bf16", show_default=True, help="Weight format, e.g. int4-g128, fp8-e4m3.")
@click.option("--kv", default="bf16", show_default=True, help="KV-cache format: bf16 fp16 fp8-e4m3 fp8-e5m2 int8 "
              "int4 int2 (groups allowed, e.g. int4-g32-asym), or fewbits' own cache with its residual written "
              "out (int4-g32-r128, int2-r128, int8-r0, fp8-e4m3-r0): its true bytes, 16-bit window included.")
@click.option("--activations", "-a", default="auto", show_default=True,
              type=click.Choice(["auto", "bf16", "fp16", "fp8", "int8", "fp4"]),
              help="Activation precision (W8A8: fp8 or int8); auto = fp8 for fp8 weights, BF16 otherwise.")
@click.option("--devices", "-n", type=int, default=1, show_default=True, help="Tensor-parallel devices.")
@click.option("--profile", "-p", default="default", show_default=True, help="seed, default, or a profile JSON.")
@click.option("--table-weights", callback=_csv, default=None, help="Comma list of weight formats for the table.")
@click.option("--table-kv", callback=_csv, default=None, help="Comma list of KV formats for the table.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Draw weight/KV bytes and step time of each format pair to FILE.png or FILE.svg.")
@click.option("--misfit", type=click.Choice(MISFIT_POLICIES), default="error", show_default=True,
              help="A layer whose width the group size does not divide: an error, regroup (the largest group "
                   "that divides, as `fewbits quantize --misfit regroup`), or keep it 16-bit.")
@click.option("--lm-head", "lm_head", default=None,
              help="The LM head's own format, as `fewbits quantize --lm-head` stores it (default: kept 16-bit).")
@click.option("--sweep", "do_sweep", is_flag=True,
              help="Sweep axes given as arguments: batch=1,8,32 context=1024,8192.")
@click.argument("axes", nargs=-1)
def plan_cmd(model: str, device: str | None, batch: int, context: int, weights: str, kv: str, activations: str,
             devices: int, profile: str, table_weights: tuple[str, ...] | None, table_kv: tuple[str, ...] | None,
             as_json: bool, plot: str | None, misfit: str, lm_head: str | None, do_sweep: bool,
             axes: tuple[str, ...]) -> None:
    """Predict bytes, time and memory of a decode step (and prefill) for MODEL on DEVICE."""
    for name, v in (("--batch", batch), ("--context", context), ("--devices", devices)):
        if v <= 0:
            raise click.BadParameter(f"must be a positive integer, got {v}", param_hint=name)
    if axes and not do_sweep:
        raise click.UsageError(f"unexpected arguments {' '.join(axes)} (did you mean --sweep {' '.join(axes)}?)")
    if plot and Path(plot).suffix.lower() not in (".png", ".svg"):
        raise click.BadParameter(f"{plot}: the plot is written as .png or .svg", param_hint="--plot")
    if plot and not (Path(plot).parent.is_dir() and os.access(Path(plot).parent, os.W_OK)):
        raise click.BadParameter(f"{plot}: folder {Path(plot).parent} does not exist or is not writable",
                                 param_hint="--plot")
    try:
        rep = plan_report(model, device, batch, context, weights, kv, devices, profile, activations, table_weights,
                          table_kv, misfit, lm_head, _parse_axes(axes) if do_sweep else None)
    except ValueError as e:  # ModelSpecError, DeviceError, ProfileError, FormatError, PlanError
        raise click.ClickException(str(e)) from None
    r, out, sweep_lines = rep.result, rep.data, rep.sweep_lines
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(format_breakdown(r))
        for line in sweep_lines:
            click.echo(line)
    if plot:
        if do_sweep:
            _save(sweep_figure(out["sweep"], r), plot)
        else:
            _plot(r, plot)
        if not as_json:
            click.echo(f"wrote {plot}")


def _plot(r: PlanResult, path: str) -> None:
    """Stacked bytes per step (weights blue, KV amber) and step time for each format pair."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rows = list(r.table)
    labels = [f"W {t.weights} · KV {t.kv}" for t in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.6), sharey=True,
                                   gridspec_kw={"width_ratios": [2, 1]})
    y = range(len(rows))
    wb = [t.weight_bytes / 1e9 for t in rows]
    kb = [t.kv_bytes / 1e9 for t in rows]
    ax1.barh(y, wb, color="#3b6fd4", label="weight bytes")
    ax1.barh(y, kb, left=wb, color="#e8a33d", label="KV-cache bytes")
    ax1.set_yticks(list(y), labels)
    ax1.invert_yaxis()
    ax1.set_xlabel("GB read per decode step")
    ax1.legend(loc="lower right", fontsize=8)
    times = [t.time_s * 1e3 for t in rows]
    ax2.barh(y, times, color=["#888" if t.fits else "#c44" for t in rows])
    for yi, t in zip(y, times, strict=True):
        ax2.text(t, yi, f" {t:.1f} ms", va="center", fontsize=8)
    ax2.set_xlabel("step time (ms); red: does not fit")
    ax2.set_xlim(0, max(times) * 1.3)
    dev = f"{r.devices}x {r.device}" if r.devices > 1 else r.device
    fig.suptitle(f"{r.model} on {dev}: batch {r.batch}, context {r.context} (profile {r.profile})", fontsize=10)
    fig.tight_layout()
    try:
        _save(fig, path)
    finally:
        plt.close(fig)


def sweep_figure(data: dict, r: PlanResult):  # noqa: ANN201 - a matplotlib Figure
    """The sweep: tokens/s and step time against batch, one line per context; hollow markers: does not fit."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    batch, context = data["batch"], data["context"]
    fig = Figure(figsize=(11, 4.2))
    ax1, ax2 = fig.subplots(1, 2)
    for ci, c in enumerate(context):
        tps = [data["tokens_per_s"][bi][ci] for bi in range(len(batch))]
        ms = [data["time_s"][bi][ci] * 1e3 for bi in range(len(batch))]
        fits = [data["fits"][bi][ci] for bi in range(len(batch))]
        line = ax1.plot(batch, tps, marker="o", label=f"context {c:g}")[0]
        ax2.plot(batch, ms, marker="o", color=line.get_color())
        bad = [i for i, f in enumerate(fits) if not f]
        for ax, ys in ((ax1, tps), (ax2, ms)):
            ax.scatter([batch[i] for i in bad], [ys[i] for i in bad], s=90, facecolors="white",
                       edgecolors="#c44", zorder=3)
    for ax, label in ((ax1, "tokens/s (all sequences)"), (ax2, "decode step time (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batch, [f"{b:g}" for b in batch])
        ax.set_yscale("log")
        ax.set_xlabel("batch (sequences decoded together)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8, title="red rings: does not fit", title_fontsize=8)
    dev = f"{r.devices}x {r.device}" if r.devices > 1 else r.device
    fig.suptitle(f"{r.model} on {dev}, weights {r.weights}, KV {r.kv} (profile {r.profile})", fontsize=10)
    fig.tight_layout()
    return fig


def _save(fig, path: str) -> None:  # noqa: ANN001
    """Write a figure to `path` (png or svg): a temporary file in the same folder, then renamed."""
    from fewbits.files import write_file

    target = Path(path)
    write_file(target, lambda tmp: fig.savefig(tmp, format=target.suffix.lstrip(".").lower(), dpi=120), True)
