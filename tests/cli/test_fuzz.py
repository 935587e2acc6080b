"""Fuzzing the inputs a user types (hypothesis, derandomised, bounded: about 30 s in all, 1200 inputs): format specs,
config.json files for `plan`, and the arguments of plan / try / layer-error / formats through click's
CliRunner.  Every input must either work (exit 0) or get a one-line error naming the problem (exit 1 or
2): no traceback, no hang (an example that runs past HANG_S fails).

With FEWBITS_FUZZ_STATS=FILE the tests only count (tried / clean / defects, and the first message of
each kind of defect) into FILE as JSON instead of failing: how the campaign's figures were made, also
against an older checkout."""

from __future__ import annotations

import json
import math
import os
import signal
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fewbits.cli import main
from fewbits.formats.format import FormatError, parse_format

HANG_S = 20
STATS_FILE = os.environ.get("FEWBITS_FUZZ_STATS")
STATS: Counter = Counter()
DEFECTS: dict[str, str] = {}
FUZZ = settings(derandomize=True, deadline=None, database=None, max_examples=200,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DATA = Path(__file__).parents[1] / "models" / "data"
SMOL = json.loads((DATA / "smollm2_135m_config.json").read_text())
_TMP = tempfile.TemporaryDirectory(prefix="fewbits-fuzz-")


@pytest.fixture(scope="module", autouse=True)
def _write_stats():
    yield
    if STATS_FILE:
        Path(STATS_FILE).write_text(json.dumps({"counts": dict(STATS), "defects": DEFECTS}, indent=1))


def _alarm(signum, frame):  # noqa: ANN001
    raise TimeoutError(f"no answer within {HANG_S} s")


def _invoke(args: list[str]):  # noqa: ANN202
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S)
    try:
        return CliRunner().invoke(main, args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _outcome(name: str, args: list[str]) -> None:
    """Run the command; count it; fail (unless only counting) when it did not end cleanly."""
    r = _invoke(args)
    STATS[f"{name}:tried"] += 1
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error")]
    escaped = r.exception is not None and not isinstance(r.exception, SystemExit)
    clean = (r.exit_code == 0 and not escaped) or (r.exit_code in (1, 2) and not escaped and len(errors) == 1)
    clean = clean and "Traceback" not in r.output and "nan%" not in r.output
    if clean:
        STATS[f"{name}:clean"] += 1
        STATS[f"{name}:worked"] += r.exit_code == 0
        return
    STATS[f"{name}:defects"] += 1
    kind = f"{name}: {type(r.exception).__name__ if escaped else 'exit ' + str(r.exit_code)}"
    DEFECTS.setdefault(kind, f"{args!r} -> {repr(r.exception) if escaped else r.output[-300:]}")
    if not STATS_FILE:
        raise AssertionError(f"{args!r} did not end cleanly: exit {r.exit_code}, {r.exception!r}\n{r.output[-2000:]}")


# ------------------------------------------------------------------------------------------- strategies
SPEC_ALPHABET = "intfpgbsymzrx0123456789-e4m3nvfasdq."
SPEC_PARTS = ["int4", "int8", "int3", "int2", "int9", "int0", "fp8-e4m3", "fp8-e5m2", "fp4", "nf4", "mxfp4", "mxfp8",
              "nvfp4", "bf16", "fp16", "fp32", "-g32", "-g0", "-g7", "-g-1", "-g99999999999", "-t", "-asym", "-sfp32",
              "-sbf16", "-se8m0", "-zfp16", "-r128", "-r-1", "-g", "-", "int", ""]
specs = st.one_of(st.text(alphabet=SPEC_ALPHABET, max_size=24),
                  st.lists(st.sampled_from(SPEC_PARTS), min_size=1, max_size=5).map("".join),
                  st.text(max_size=12))
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                         st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                 st.dictionaries(st.text(max_size=6), inner,
                                                                                 max_size=3)), max_leaves=8)
numbers = st.one_of(st.integers(-3, 70_000).map(str), st.sampled_from(["0", "-1", "1e9", "nan", "inf", "-inf",
                                                                       "2" * 30, "1.5", "", "x", "0x10", " 7"]))


def _config_file(text: str | bytes) -> str:
    fd, path = tempfile.mkstemp(dir=_TMP.name, suffix=".json")
    with os.fdopen(fd, "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return path


# ------------------------------------------------------------------------------------------------ tests
@FUZZ
@given(specs)
def test_format_specs(spec: str) -> None:
    try:
        fmt = parse_format(spec)
    except FormatError as e:  # a ValueError naming the spec, on one line
        assert "\n" not in str(e).strip()
    else:
        assert parse_format(fmt.spec) == fmt and math.isfinite(fmt.bits_per_weight((64, 4096)) if fmt.is_quantized
                                                                else 16.0)
    _outcome("formats", ["formats", spec, "--shape", "64x4096"])


@FUZZ
@given(st.sampled_from(["hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                        "intermediate_size", "vocab_size", "head_dim", "model_type", "max_position_embeddings",
                        "tie_word_embeddings", "text_config"]), json_values)
def test_plan_config_one_field(field: str, value: object) -> None:
    try:
        text = json.dumps({**SMOL, field: value})
    except (ValueError, TypeError):
        return
    _outcome("plan-config", ["plan", "--model", _config_file(text)])


@FUZZ
@given(st.one_of(json_values.map(lambda v: json.dumps(v)), st.binary(max_size=64), st.text(max_size=64)))
def test_plan_config_whole_file(text: str | bytes) -> None:
    _outcome("plan-config", ["plan", "--model", _config_file(text)])


@FUZZ
@given(st.fixed_dictionaries({}, optional={
    "--batch": numbers, "--context": numbers, "--devices": numbers, "--weights": specs, "--kv": specs,
    "--device": st.sampled_from(["h100", "cpu", "h200", "nope", "", "H100", "a100-40gb"]),
    "--profile": st.sampled_from(["seed", "default", "missing.json", ""]),
    "--model": st.sampled_from(["smollm2-135m", "llama-3-8b", "mixtral-8x7b", "nope", "", "/dev/null"]),
    "--misfit": st.sampled_from(["error", "keep", "regroup", "x"]),
    "--lm-head": specs, "--activations": st.sampled_from(["auto", "fp8", "int4"])}),
    st.lists(st.sampled_from(["batch=1,8", "context=0", "batch=", "x=1", "context=1,2,3", "batch=-1"]),
             max_size=2))
def test_plan_arguments(opts: dict[str, str], axes: list[str]) -> None:
    args = ["plan"] + [x for kv in opts.items() for x in kv]
    _outcome("plan-args", args + (["--sweep", *axes] if axes else []))


@FUZZ
@given(st.fixed_dictionaries({}, optional={"--bits": numbers, "--group": numbers, "--seed": numbers}),
       st.booleans(), st.booleans())
def test_try_arguments(opts: dict[str, str], outlier: bool, asym: bool) -> None:
    args = ["try"] + [x for kv in opts.items() for x in kv]
    _outcome("try-args", args + ["--outlier"] * outlier + ["--asym"] * asym)


small = st.one_of(st.integers(-2, 96).map(str), st.sampled_from(["100000", "nan", "", "1e3", "4096"]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(["nan", "inf", "x"]))


@FUZZ
@given(st.fixed_dictionaries({}, optional={
    "--rows": small, "--cols": small, "--w-std": floats, "--outlier-channel": small, "--outlier-value": floats,
    "--threshold": floats, "--weights": st.lists(specs, min_size=1, max_size=3).map(",".join),
    "--scales": st.sampled_from(["fp64", "fp16", "bf16", "fp8"]), "--seed": numbers}))
def test_layer_error_arguments(opts: dict[str, str]) -> None:
    opts.setdefault("--rows", "64")
    opts.setdefault("--cols", "64")
    _outcome("layer-error-args", ["layer-error"] + [x for kv in opts.items() for x in kv])
