"""`fewbits ui` starts uvicorn on 127.0.0.1 and serves the pages and the API."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
from click.testing import CliRunner

from fewbits.cli import main


def test_ui_serves_until_stopped(tmp_path) -> None:  # noqa: ANN001
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "fewbits", "ui", "--no-open", "--port", str(port),
                             "--results", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                r = httpx.get(url + "/api/options", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise AssertionError("fewbits ui did not answer in 30 s")
        assert r.status_code == 200 and "llama-3-8b" in r.json()["models"]
        assert httpx.get(url + "/api/results").json() == {"root": tmp_path.name, "reports": []}
        assert "decode explorer" in httpx.get(url + "/").text
    finally:
        proc.terminate()
        out = proc.communicate(timeout=10)[0].decode()
    assert f"http://127.0.0.1:{port}/" in out


def test_ui_bad_options() -> None:
    res = CliRunner().invoke(main, ["ui", "--results", "/no/such/folder", "--no-open"])
    assert res.exit_code != 0 and "/no/such/folder" in res.output
    res = CliRunner().invoke(main, ["ui", "--port", "70000", "--no-open"])
    assert res.exit_code != 0 and "70000" in res.output
