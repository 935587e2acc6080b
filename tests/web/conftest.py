"""Fixtures of the web tests: the app on a free port in a thread, a report folder, headless Chromium."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the ui extra (fastapi, uvicorn) is not installed")

from fewbits.web.app import create_app  # noqa: E402

DEMO_ROWS = [
    {"method": "rtn", "format": f, "bits_per_weight": b, "size_bytes": 1e8, "ref_size_bytes": 2.7e8,
     "overall": {"ppl": p, "ref_ppl": 10.0, "delta_ppl": p - 10.0, "kl_mean": kl, "kl_p99": 10 * kl, "top1": t,
                 "tokens": 1000, "windows": 4},
     "categories": {"prose": {"kl_mean": kl * 0.8, "top1": t + 0.01}, "code": {"kl_mean": kl * 1.3, "top1": t - 0.02}}}
    for f, b, p, kl, t in (("int8", 8.25, 10.01, 0.002, 0.98), ("int4-g64", 4.25, 10.6, 0.05, 0.90),
                            ("int3-g64", 3.25, 12.0, 0.2, 0.80))]


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A report folder: a demo's results.json and a bench --json file, plus a file that is not a report."""
    root = tmp_path_factory.mktemp("reports")
    (root / "demo").mkdir()
    (root / "demo" / "results.json").write_text(json.dumps({"version": 1, "model": "smollm2-135m", "rows": DEMO_ROWS,
                                                              "wall_seconds": 100.0}))
    bench = Path(__file__).parents[2] / "benchmarks/results/h200-2026-11-30/call1/bench-smollm2.json"
    if bench.is_file():
        shutil.copy(bench, root / "bench.json")
    (root / "smol-int4").mkdir()
    (root / "smol-int4" / "fewbits.json").write_text(json.dumps(
        {"format": "fewbits.quantized", "version": 2, "source": "smollm2-135m", "dtype": "bfloat16",
         "recipe": {"default": "int4-g64"}, "size_bytes": 123, "layers": {"a": 1}, "report": None}))
    (root / "notes.json").write_text(json.dumps({"hello": 1}))
    return root


@pytest.fixture(scope="session")
def app(results_dir: Path):  # noqa: ANN201
    return create_app(results=results_dir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(app) -> Iterator[str]:  # noqa: ANN001
    """The app served by uvicorn on 127.0.0.1 in a thread; yields its base URL."""
    import uvicorn

    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    assert srv.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    t.join(10)


def require_chromium() -> tuple[str, str]:
    """(chromium, chromedriver) paths; without them a skip with the reason, or a failure when CI=true."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser and driver:
        return browser, driver
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail("CI=true but chromium/chromedriver are missing (apt-get install chromium chromium-driver)")
    pytest.skip("chromium and chromedriver not installed (apt-get install chromium chromium-driver)")


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    """Headless Debian chromium through Selenium (no browser download); skipped without it, except in CI."""
    paths = require_chromium()
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but selenium is not installed (the test extra)")
        pytest.skip("selenium is not installed")
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not fetch anything
    opts = webdriver.ChromeOptions()
    opts.binary_location = paths[0]
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1400"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(executable_path=paths[1]), options=opts)
    drv.set_page_load_timeout(30)
    try:
        yield drv
    finally:
        drv.quit()


@pytest.fixture(scope="session")
def artefacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go: $FEWBITS_ARTEFACTS, else a temporary folder."""
    where = os.environ.get("FEWBITS_ARTEFACTS")
    p = Path(where) if where else tmp_path_factory.mktemp("artefacts")
    p.mkdir(parents=True, exist_ok=True)
    return p
