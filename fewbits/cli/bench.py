"""`fewbits bench MODEL`: measured decode speed per weight and KV format beside the cost model's prediction."""

from __future__ import annotations

import json

import click

from fewbits.bench.timing import WARMUP_STEPS
from fewbits.files import check_output, write_text


def _ints(s: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in s.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {s!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise click.BadParameter(f"expected positive integers, got {s!r}")
    return vals


def _strs(s: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in s.split(",") if v.strip())


def _memory_read(device: str) -> float:
    """Bytes/s of a read of 1 GiB on `device`, as `fewbits probe` measures its bandwidth."""
    from fewbits.bench.machine import memory_bandwidth

    return memory_bandwidth(1 << 30, device=device)


def _matmul_rate(device: str) -> float:
    """FLOP/s of an fp32 GEMM on `device`, as `fewbits probe` measures its matmul rates."""
    from fewbits.bench.machine import matmul_rates, matmul_size

    return matmul_rates(matmul_size(device), device=device, only=("fp32",))["fp32"]


def _drift_line(probed: float, now: float, when: str) -> str:
    return (f"memory read {when}: {now / 1e9:.1f} GB/s, {now / probed:.2f}x the profile's {probed / 1e9:.1f} GB/s"
            + ("" if abs(now / probed - 1) <= 0.1 else
               " (the host is not as it was probed, e.g. other processes' load: the predictions assume the "
               "profile's machine; probe again to compare them now)"))


def _compute_line(probed: float, now: float) -> str:
    """The fp32 GEMM rate before the rows beside the profile's: the rows that arithmetic bounds (a CPU's batch-8
    steps) move with it as the memory-bound ones move with the memory read (on a shared 2-core EPYC one probe
    read 91 GFLOP/s, the same GEMM 124-180 half an hour later, and its batch-8 rows came out 31-38% slow)."""
    return (f"fp32 matmul before the rows: {now / 1e9:.0f} GFLOP/s, {now / probed:.2f}x the profile's "
            f"{probed / 1e9:.0f} GFLOP/s" + ("" if abs(now / probed - 1) <= 0.1 else
                                              " (rows bound by arithmetic, as a CPU's batch-8 steps, move with it)"))


@click.command("bench")
@click.argument("model")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False), default=None,
              help="device profile JSON from `fewbits probe` (measured now when not given)")
@click.option("--weights", default="bf16,int8,int4-g64,fp8-e4m3", show_default=True)
@click.option("--kv", default="bf16,fp8-e4m3,int8,int4,int2", show_default=True)
@click.option("--batch", default="1,8", show_default=True)
@click.option("--prompt", default="128,512", show_default=True)
@click.option("--steps", type=int, default=8, show_default=True, help="timed decode steps per row")
@click.option("--warmup", type=int, default=WARMUP_STEPS, show_default=True,
              help="untimed decode steps after each prefill, before the timed ones (the last-level cache takes the "
                   "weights back over the first steps: here up to 1.6x slower)")
@click.option("--full", is_flag=True, help="every weight format with every KV format (default: each axis alone)")
@click.option("--threads", type=int, default=0, help="torch threads (use the probe's)")
@click.option("--rounds", type=int, default=1, show_default=True,
              help="measure every row once per round and keep its fastest step (a host whose speed drifts)")
@click.option("--device", default="cpu", show_default=True,
              help="where the model runs: cpu, or a CUDA device (cuda, cuda:1); use a profile probed there")
@click.option("--lm-head", "lm_head", default=None,
              help="quantise the LM head of the quantised weight formats too, to this format (e.g. int8)")
@click.option("--activations", type=click.Choice(["16", "q8"]), default="16", show_default=True,
              help="q8: kernels that can round the activations to int8 per block of 32 columns do (llama.cpp's "
                   "Q8_0; CPU with AVX512-VNNI or AVX2), 16: weight-only kernels")
@click.option("--random-weights", is_flag=True,
              help="build MODEL (a built-in name or a config.json) with random weights instead of loading them: "
                   "for speed only, where the weights cannot be had")
@click.option("--eager", is_flag=True,
              help="decode with the model's own eager forward instead of the compiled static-cache step")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="also write rows as JSON")
def bench_cmd(model: str, profile_path: str | None, weights: str, kv: str, batch: str, prompt: str, steps: int,
              warmup: int, full: bool, threads: int, rounds: int, device: str, lm_head: str | None, activations: str,
              random_weights: bool, eager: bool, json_out: str | None) -> None:
    """Decode step time and tokens/s at each batch and prompt length, for the 16-bit model and each quantised
    weight format and KV-cache format, with the cost model's prediction and its error.  Decode runs the compiled
    static-cache step (compiled graphs cached on disk under $FEWBITS_CACHE/inductor; compile time shown apart)
    unless --eager.  With a probed --profile, memory is read as the probe read it, before and after the rows,
    beside the profile's bandwidth, and an fp32 GEMM is timed before them beside the profile's rate: a host slower
    or faster than when probed moves every measurement away from its prediction."""
    import torch

    from fewbits.bench.decode import HEADER, BenchMemoryError, run_bench, summary
    from fewbits.cost.profile import load_profile
    from fewbits.formats.format import parse_format
    from fewbits.generate import check_device
    from fewbits.kvcache.format import parse_kv_format

    if threads:
        torch.set_num_threads(threads)
    wl, kl = _strs(weights), _strs(kv)
    for w in wl + ((lm_head,) if lm_head else ()):
        parse_format(w)
    for k in kl:
        parse_kv_format(k)
    if steps < 1:
        raise click.BadParameter("--steps must be >= 1")
    if rounds < 1:
        raise click.BadParameter("--rounds must be >= 1")
    if warmup < 0:
        raise click.BadParameter("--warmup must be >= 0")
    try:
        dev = str(check_device(device))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--device") from None
    if profile_path is None:
        from fewbits.bench.decode import model_spec
        from fewbits.bench.probe import build_profile
        from fewbits.models.loading import load_model
        from fewbits.models.presets import resolve_model

        click.echo("no --profile: probing this machine first (fewbits probe writes one to reuse)")
        try:  # a built-in name or a config.json: its shapes without loading anything
            spec = resolve_model(model)
        except Exception:  # noqa: BLE001 - else the loaded model's own config
            spec = model_spec(model, load_model(model, dtype="bf16")[0])
        prof = build_profile(spec, log=click.echo, device=dev)
    else:
        prof = load_profile(profile_path)
    click.echo(f"profile {prof.name}: {prof.device.name if prof.device else 'datasheet device'}; "
               f"torch threads {torch.get_num_threads()}")
    # a probed profile's bandwidth beside the same read now and after the rows: on a shared host the machine's
    # speed drifts (one afternoon: 60 GB/s at a probe, 34 GB/s at the bench after it), and a prediction can only
    # be as near the measurement as the machine is to its profile
    measured = (prof.measured or {}) if profile_path is not None else {}
    probed = float(measured.get("bandwidth") or 0.0)
    probed_flops = float((measured.get("matmul_flops") or {}).get("fp32") or 0.0)
    reads: dict[str, float] = {}
    if probed > 0:
        reads["before"] = _memory_read(dev)
        click.echo(_drift_line(probed, reads["before"], "before the rows"))
    flops_now = _matmul_rate(dev) if probed_flops > 0 else 0.0
    if flops_now > 0:
        click.echo(_compute_line(probed_flops, flops_now))
    click.echo(HEADER)
    try:
        if json_out:
            check_output(json_out, overwrite=True, kind="file")  # before the measuring
        rows = run_bench(model, prof, wl, kl, _ints(batch), _ints(prompt), steps, full, log=click.echo,
                         rounds=rounds, device=dev, random_weights=random_weights, lm_head=lm_head, eager=eager,
                         activations=activations, warmup=warmup)
    except (BenchMemoryError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(summary(rows))
    if probed > 0:
        reads["after"] = _memory_read(dev)
        click.echo(_drift_line(probed, reads["after"], "after the rows"))
    if json_out:
        data = json.dumps({"model": model, "profile": prof.name, "device": dev, "random_weights": random_weights,
                           "path": "eager" if eager else "compiled",
                           "memory_read_bytes_s": {"profile": probed, **reads} if probed > 0 else None,
                           "fp32_matmul_flops_s": {"profile": probed_flops, "before": flops_now}
                           if flops_now > 0 else None,
                           "rows": [r.to_dict() for r in rows]}, indent=1)
        write_text(json_out, data)
