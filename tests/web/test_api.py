"""The JSON API against the command line: the same inputs give the very same numbers; bad input is a 4xx
with one clear line; nothing outside the report folder is read."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from fewbits.cli import main

CONFIGS = Path(__file__).parents[1] / "models" / "data"


@pytest.fixture(scope="module")
def client(app) -> TestClient:  # noqa: ANN001
    return TestClient(app)


def cli(*args: str) -> dict:
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


@pytest.mark.parametrize("body", [
    {},
    {"model": "llama-3-70b", "device": "h200", "devices": 2, "weights": "int4-g128", "kv": "fp8-e4m3",
     "batch": 64, "context": 8192, "profile": "default", "table_weights": ["bf16", "nvfp4"], "table_kv": ["int4"]},
    {"model": "mixtral-8x7b", "device": "mi300x", "weights": "fp8-e4m3", "kv": "int4-g32-r128", "batch": 3,
     "context": 100000},
])
def test_plan_is_what_the_cli_prints(client: TestClient, body: dict) -> None:
    r = client.post("/api/plan", json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    # the command the page copies prints exactly the report the page shows
    assert d["report"] == cli(*shlex.split(d["command"])[1:], "--json")
    rep = d["report"]
    assert d["view"]["weight_bytes"] == f"{rep['weight_bytes'] / 1e9:.2f} GB"
    assert d["view"]["tokens_per_s"] == f"{rep['tokens_per_s']:.0f}"
    # each bar's total is its table row, and its parts add up to it (linear + attention + overhead + comm)
    for bar, row in zip(d["bars"], rep["table"], strict=True):
        assert bar["time_ms"] == row["time_s"] * 1e3
        assert bar["weights_ms"] + bar["cache_ms"] + bar["overhead_ms"] == pytest.approx(bar["time_ms"], rel=1e-9)


def test_plan_defaults_are_seed_000(client: TestClient) -> None:
    v = client.post("/api/plan", json={}).json()["view"]
    figures = (v["weight_bytes"], v["kv_bytes"], v["time"], v["tokens_per_s"])
    assert figures == ("15.01 GB", "8.59 GB", "9.31 ms", "1719")
    assert v["memory"] == "16.06 GB of weights + 8.59 GB of cache = 24.65 GB of 80 GB. Fits."


def test_sweep_line_is_plan_at_each_point(client: TestClient) -> None:
    d = client.post("/api/plan", json={"sweep_axis": "batch", "context": 2048}).json()
    sw = d["sweep"]
    i = sw["x"].index(32)
    line = next(ln for ln in sw["lines"] if ln["label"] == "W int8 · KV bf16")
    ref = cli("plan", "--batch", "32", "--context", "2048", "--weights", "int8", "--profile", "seed", "--json")
    assert line["tokens_per_s"][i] == pytest.approx(ref["tokens_per_s"], rel=1e-12)
    assert sw["crossover"] == pytest.approx(d["report"]["crossover_tokens"] / 2048)


def test_what_no_longer_fits(client: TestClient) -> None:
    v = client.post("/api/plan", json={"batch": 512, "context": 8192}).json()["view"]
    assert not v["fits"] and "Does not fit" in v["memory"] and "at most batch" in v["memory"]
    r = client.post("/api/plan", json={"model": "llama-3.1-405b"})
    assert r.status_code == 422 and "weights alone" in r.json()["detail"]


def test_uploaded_config_is_plan_of_that_file(client: TestClient, tmp_path: Path) -> None:
    cfg = json.loads((CONFIGS / "gemma3_4b_config.json").read_text())
    d = client.post("/api/plan", json={"config": cfg, "config_name": "gemma3_4b_config.json"}).json()
    f = tmp_path / "gemma3_4b_config.json"
    f.write_text(json.dumps(cfg))
    args = shlex.split(d["command"])[1:]
    args[args.index("--model") + 1] = str(f)
    assert d["report"] == cli(*args, "--json")


@pytest.mark.parametrize("body,words", [
    ({"batch": 10**12}, "batch: Input should be less than or equal to 65536"),
    ({"batch": 0}, "batch: Input should be greater than or equal to 1"),
    ({"context": "long"}, "context: Input should be a valid integer"),
    ({"weights": "int12"}, "int12"),
    ({"weights": "int4-g100", "model": "smollm2-135m"}, "not divisible"),
    ({"model": "llama-9"}, "unknown model 'llama-9'"),
    ({"device": "tpu9"}, "unknown device 'tpu9'"),
    ({"profile": "fewbits.json"}, "unknown profile 'fewbits.json'"),
    ({"model": "../../etc/passwd"}, "model: String should match pattern"),
    ({"model": "pyproject.toml"}, "unknown model 'pyproject.toml'"),  # a name, never opened as a file
    ({"config": {"model_type": "bert"}}, "model_type 'bert' is not supported"),
    ({"config": {"model_type": "llama"}}, "field 'hidden_size' is missing"),
    ({"config": {"a": list(range(5000))}}, "more than 2000 entries"),
    ({"config": {"model_type": "llama", "num_attention_heads": 0}}, "'num_attention_heads' must be an integer from 1"),
    ({"config": {"model_type": "llama", "hidden_size": [1]}}, "'hidden_size' must be an integer from 1"),
    ({"config": {"model_type": "llama", "intermediate_size": 1e308}}, "'intermediate_size' must be an integer"),
    ({"config": {"model_type": ["llama"]}}, "'model_type' must be a string"),
    ({"config": {"model_type": "gemma3", "text_config": {"vocab_size": -1}}}, "text_config field 'vocab_size'"),
    ({"colour": "blue"}, "colour: Extra inputs are not permitted"),
])
def test_bad_plan_inputs_are_one_clear_line(client: TestClient, body: dict, words: str) -> None:
    r = client.post("/api/plan", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and words in detail


def test_large_bodies_are_refused(client: TestClient) -> None:
    big = {"config": {"model_type": "llama", "junk": "x" * 2_000_000}}
    r = client.post("/api/plan", json=big)
    assert r.status_code == 413 and "1,000,000 bytes" in r.json()["detail"]
    r = client.post("/api/plan", content=b"{" * 10, headers={"content-type": "application/json"})
    assert r.status_code == 422


@pytest.mark.parametrize("body,args", [
    ({}, []),
    ({"bits": 3, "group": 8, "outlier": True}, ["--bits", "3", "--group", "8", "--outlier"]),
    ({"bits": 4, "group": 16, "asym": True, "seed": 7}, ["--group", "16", "--asym", "--seed", "7"]),
    ({"family": "nf4", "group": 32}, ["--family", "nf4", "--group", "32"]),
    ({"family": "mxfp4", "outlier": True}, ["--family", "mxfp4", "--outlier"]),
    ({"family": "fp8-e5m2", "group": 8}, ["--family", "fp8-e5m2", "--group", "8"]),
])
def test_try_is_what_the_cli_prints(client: TestClient, body: dict, args: list[str]) -> None:
    r = client.post("/api/try", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == cli("try", *args, "--json")


def test_try_bad_inputs(client: TestClient) -> None:
    for body, words in (({"bits": 9}, "bits: Input should be less than or equal to 8"),
                        ({"group": 12}, "group: Input should be 64, 32, 16 or 8"),
                        ({"weights": [0.1] * 63}, "weights: List should have at least 64 items"),
                        ({"weights": [1e9] * 64}, "magnitude 1e-6 to 1000"),
                        ({"weights": [1e-300] * 64}, "magnitude 1e-6 to 1000"),
                        ({"weights": [0.0] * 64}, "all zero"),
                        ({"family": "fp4", "asym": True}, "asym is for int only")):
        r = client.post("/api/try", json=body)
        assert r.status_code == 422 and words in r.json()["detail"], (body, r.text)


def test_layer_error_is_what_the_cli_prints(client: TestClient) -> None:
    d = client.post("/api/layer-error", json={}).json()
    assert d == cli("layer-error", "--json")
    assert [f"{x['rel_error']:.2%}" for x in d["weight-only"] + d["w8a8"]] == [
        "0.72%", "14.76%", "12.21%", "10.17%", "25.58%", "0.96%", "3.18%", "0.73%"]  # seed 001's table
    assert [x["weights_per_scale"] for x in d["weight-only"]] == [512, 512, 128, 32, 128]
    r = client.post("/api/layer-error", json={"weights": ["int4-g100"]})
    assert r.status_code == 422 and "not divisible by the group size 100" in r.json()["detail"]
    r = client.post("/api/layer-error", json={"rows": 10**6})
    assert r.status_code == 422 and "rows" in r.json()["detail"]


def test_results_only_from_the_given_folder(client: TestClient, results_dir: Path) -> None:
    listing = client.get("/api/results").json()
    assert listing["root"] == results_dir.name
    kinds = {r["path"]: r["kind"] for r in listing["reports"]}
    assert kinds["demo/results.json"] == "demo" and "notes.json" not in kinds
    assert kinds["smol-int4/fewbits.json"] == "quantize"
    q = next(r["id"] for r in listing["reports"] if r["kind"] == "quantize")
    meta = client.get(f"/api/results/{q}").json()["meta"]
    assert meta["recipe"] == {"default": "int4-g64"} and "layers" not in meta
    demo = next(r["id"] for r in listing["reports"] if r["path"] == "demo/results.json")
    d = client.get(f"/api/results/{demo}").json()
    from fewbits.eval.report import table_text

    rows = json.loads((results_dir / "demo/results.json").read_text())["rows"]
    assert d["table"] == table_text(rows)
    assert [q["kl_mean"] for q in d["quality"]] == [r["overall"]["kl_mean"] for r in rows]
    assert client.get("/api/results/999").status_code == 422
    assert client.get("/api/results/..%2F..%2Fetc%2Fpasswd").status_code in (404, 422)  # not a number: no route
    assert client.get("/static/../../pyproject.toml").status_code == 404


def test_no_results_folder_and_the_pages() -> None:
    from fewbits.web.app import create_app

    c = TestClient(create_app())
    assert c.get("/api/results").json()["reports"] == []
    assert c.get("/api/results/0").status_code == 422
    for page in ("/", "/playground", "/results"):
        r = c.get(page)
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert c.get("/static/vendor/chartjs/chart.umd.min.js").status_code == 200
    assert "/api/plan" in c.get("/openapi.json").json()["paths"]


def test_browser_tests_skip_locally_but_fail_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from tests.web.conftest import require_chromium

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="chromium"):
        require_chromium()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require_chromium()


def test_a_probed_profile_given_at_start(tmp_path: Path) -> None:
    """A profile file passed to `fewbits ui --profile` is offered by name; the page's command names the file."""
    import shutil

    from fewbits.web.app import create_app

    src = Path(__file__).parents[2] / "benchmarks/results/h200-2026-11-30/call1/probe-smollm2.json"
    if not src.is_file():
        pytest.skip("the H200 probe file is not in this checkout")
    prof = tmp_path / "gpu.json"
    shutil.copy(src, prof)
    c = TestClient(create_app(profiles=(str(prof),)))
    opts = c.get("/api/options").json()
    name = json.loads(prof.read_text())["name"]
    assert name in opts["profiles"] and "profile" in opts["devices"]
    d = c.post("/api/plan", json={"model": "smollm2-135m", "device": "profile", "profile": name, "batch": 1,
                                  "context": 2048}).json()
    assert f"--profile {prof}" in d["command"]
    assert d["report"] == cli(*shlex.split(d["command"])[1:], "--json")
    assert d["report"]["device"].startswith("NVIDIA H200")
