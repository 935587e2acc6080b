"""`fewbits plan`: predict decode speed and memory of a model on a device in given formats.

Pure Python + numpy on its default path (matplotlib only for --plot); never imports torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from fewbits.cost.devices import DeviceError
from fewbits.cost.plan import PlanError, PlanResult, format_breakdown, plan
from fewbits.cost.profile import ProfileError
from fewbits.formats.format import MISFIT_POLICIES, FormatError
from fewbits.models.spec import ModelSpecError

DEFAULT_SWEEP = {"batch": (1, 8, 32, 128), "context": (1024, 4096, 16384, 65536)}


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
    from fewbits.cost.plan import TABLE_KV, TABLE_WEIGHTS

    try:
        r = plan(model, device, batch, context, weights, kv, devices, profile, activations,
                 table_weights or TABLE_WEIGHTS, table_kv or TABLE_KV, misfit, lm_head)
    except (ModelSpecError, DeviceError, ProfileError, FormatError, PlanError) as e:
        raise click.ClickException(str(e)) from None
    if not r.weights_fit:
        fitting = list(dict.fromkeys(t.weights for t in r.table if t.fits))
        usable_one = (r.memory_capacity - r.memory_headroom) / r.devices
        need = math.ceil(r.memory_weights / usable_one)
        hint = f"; formats that fit at this batch/context: {', '.join(fitting)}" if fitting else ""
        hint += f"; the weights alone need at least {need} devices"
        raise click.ClickException(
            f"{r.model} in {r.weights} needs {r.memory_weights / 1e9:.1f} GB for its weights alone, but "
            f"{r.devices} x {r.device} hold {r.memory_capacity / 1e9 - r.memory_headroom / 1e9:.1f} GB "
            f"({r.memory_capacity / 1e9:.0f} GB less {r.memory_headroom / 1e9:.1f} GB headroom); try a smaller "
            f"format or more --devices{hint}")
    out = r.to_dict()
    sweep_lines: list[str] = []
    if do_sweep:
        sweep_lines, out["sweep"] = _sweep(r, model, device, profile, activations, devices, _parse_axes(axes), misfit,
                                           lm_head)
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(format_breakdown(r))
        for line in sweep_lines:
            click.echo(line)
    if plot:
        _plot(r, plot)
        if not as_json:
            click.echo(f"wrote {plot}")


def _sweep(r: PlanResult, model: str, device: str | None, profile: str, activations: str, devices: int,
           axes: dict[str, tuple[int, ...]], misfit: str = "error", lm_head: str | None = None
           ) -> tuple[list[str], dict]:
    from fewbits.cost.plan import pick_device
    from fewbits.cost.profile import load_profile
    from fewbits.cost.sweep import format_sweep_table, summarize, sweep

    try:
        dev = pick_device(device, load_profile(profile))
        res = sweep(model, dev, axes["batch"], axes["context"], (r.weights,), (r.kv,), devices, profile, activations,
                    misfit, lm_head)
        lines = summarize(res, model, dev, devices, profile, activations, misfit=misfit, lm_head=lm_head)
    except (ModelSpecError, DeviceError, ProfileError, FormatError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    data = {"batch": res.batch.tolist(), "context": res.context.tolist(), "time_s": res.time[0, 0].tolist(),
            "tokens_per_s": res.tokens_per_s[0, 0].tolist(), "compute_bound": res.compute_bound[0, 0].tolist(),
            "fits": res.fits[0, 0].tolist(), "summary": lines}
    return ["", "sweep:", format_sweep_table(res), "", *lines], data


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
    from fewbits.files import write_file

    target = Path(path)
    try:
        write_file(target, lambda tmp: fig.savefig(tmp, format=target.suffix.lstrip(".").lower(), dpi=120), True)
    finally:
        plt.close(fig)
