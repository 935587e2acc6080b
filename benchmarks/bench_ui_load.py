"""Load on the decode explorer's API: N concurrent clients POST /api/plan for S seconds on 127.0.0.1.

Starts `python -m fewbits ui --no-open` on a free port (or uses --url), runs the clients in one asyncio
loop with httpx, each sending states that differ (batch, context, formats) so that nothing is answered
from a cache, and prints p50/p99 latency, throughput and the error count.  Client and server share this
machine's cores, so the figures are a floor for the server alone.

    python benchmarks/bench_ui_load.py --clients 50 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

STATES = [{"batch": b, "context": c, "weights": w, "kv": k}
          for b, c, w, k in itertools.product((1, 8, 16, 64), (1024, 4096, 32768), ("bf16", "int8", "int4-g128"),
                                              ("bf16", "fp8-e4m3"))]


async def client(http: httpx.AsyncClient, url: str, stop: float, lat: list[float], errors: list[str], k: int) -> None:
    for i in itertools.count(k):
        if time.perf_counter() >= stop:
            return
        t0 = time.perf_counter()
        try:
            r = await http.post(url + "/api/plan", json=STATES[i % len(STATES)])
            ok = r.status_code == 200 and "report" in r.json()
            if not ok:
                errors.append(f"{r.status_code}: {r.text[:100]}")
        except httpx.HTTPError as e:
            errors.append(repr(e))
            continue
        lat.append(time.perf_counter() - t0)


async def run(url: str, clients: int, seconds: float) -> tuple[list[float], list[str], float]:
    lat: list[float] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=30, limits=limits) as http:
        await http.post(url + "/api/plan", json={})  # warm: imports done before the clock starts
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http, url, t0 + seconds, lat, errors, k) for k in range(clients)))
        wall = time.perf_counter() - t0
    return lat, errors, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--url", default=None, help="a running `fewbits ui` (default: start one)")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "fewbits", "ui", "--no-open", "--port", str(port)], env=env)
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                httpx.get(url + "/api/options", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
    try:
        lat, errors, wall = asyncio.run(run(url, args.clients, args.seconds))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    ms = np.array(lat) * 1e3
    print(f"{args.clients} clients, {wall:.1f} s, POST /api/plan on {url} (cpus: {os.cpu_count()})")
    print(f"requests {len(lat)}, throughput {len(lat) / wall:.1f} req/s, errors {len(errors)}")
    if len(ms):
        print(f"latency ms: p50 {np.percentile(ms, 50):.1f}  p90 {np.percentile(ms, 90):.1f}  "
              f"p99 {np.percentile(ms, 99):.1f}  max {ms.max():.1f}")
    for e in errors[:5]:
        print("error:", e)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
