"""Report folders for the results page: only the folder given on the command line, read, never written.

`ResultsFolder(root)` lists the JSON reports below `root` (a `demo` or `eval` results.json, a `bench
--json` file, a `quantize` folder's fewbits.json) and hands them out by number, so a request names an
index, never a path.  Files are read only when they resolve inside `root` and are at most `MAX_BYTES`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_BYTES = 20_000_000
MAX_FILES = 500
MAX_DEPTH = 4


class ResultsError(ValueError):
    """A report that cannot be read (not JSON, too large, an unknown kind)."""


@dataclass(frozen=True)
class ReportFile:
    index: int
    path: Path
    rel: str


def _kind(data: Any, name: str) -> str | None:
    if not isinstance(data, dict):
        return None
    if name == "fewbits.json" and ("recipe" in data or "format" in data):
        return "quantize"
    rows = data.get("rows")
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
        if "measured_ms" in rows[0] and "predicted_ms" in rows[0]:
            return "bench"
        if "overall" in rows[0]:
            return "demo" if "wall_seconds" in data else "eval"
    return None


def _clean(x: Any) -> Any:
    """JSON-safe copy: NaN and infinities become None (the browser's JSON has no NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


class ResultsFolder:
    """The report files under one folder the user chose when starting `fewbits ui`."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ResultsError(f"--results {root}: not a folder")
        self.files = self._scan()

    def _scan(self) -> list[ReportFile]:
        found: list[ReportFile] = []
        for p in sorted(self.root.rglob("*.json")):
            if len(found) >= MAX_FILES:
                break
            rel = p.relative_to(self.root)
            if len(rel.parts) > MAX_DEPTH or any(part.startswith(".") for part in rel.parts):
                continue
            if not self._inside(p) or p.stat().st_size > MAX_BYTES:
                continue
            try:
                kind = _kind(json.loads(p.read_text()), p.name)
            except (OSError, ValueError, UnicodeDecodeError):
                continue
            if kind is not None:
                found.append(ReportFile(len(found), p, rel.as_posix()))
        return found

    def _inside(self, p: Path) -> bool:
        try:
            return p.resolve().is_relative_to(self.root)
        except OSError:
            return False

    def listing(self) -> list[dict[str, Any]]:
        out = []
        for f in self.files:
            data = json.loads(f.path.read_text())
            out.append({"id": f.index, "path": f.rel, "kind": _kind(data, f.path.name)})
        return out

    def read(self, index: int) -> dict[str, Any]:
        """The report `index` with its kind, its table as the CLI prints it and the series of its charts."""
        if not 0 <= index < len(self.files):
            raise ResultsError(f"no report {index}; this folder has {len(self.files)}")
        f = self.files[index]
        if not self._inside(f.path) or f.path.stat().st_size > MAX_BYTES:
            raise ResultsError(f"{f.rel} is no longer readable inside {self.root.name}")
        data = json.loads(f.path.read_text())
        kind = _kind(data, f.path.name)
        out: dict[str, Any] = {"id": index, "path": f.rel, "kind": kind}
        if kind in ("demo", "eval"):
            from fewbits.eval.report import table_text

            rows = data["rows"]
            out["table"] = table_text(rows)
            out["quality"] = [{"method": r.get("method"), "format": r.get("format"),
                               "bits_per_weight": r.get("bits_per_weight"),
                               "kl_mean": r["overall"].get("kl_mean"), "top1": r["overall"].get("top1"),
                               "categories": {c: {"kl_mean": v.get("kl_mean"), "top1": v.get("top1")}
                                              for c, v in r.get("categories", {}).items()}} for r in rows]
        elif kind == "bench":
            out["model"], out["device"] = data.get("model"), data.get("device")
            out["steps"] = [{k: r.get(k) for k in ("weights", "kv", "batch", "prompt", "measured_ms", "predicted_ms",
                                                   "error_pct", "tokens_per_s", "bound", "kernels")}
                            for r in data["rows"]]
        else:  # a quantised model's fewbits.json: what was stored, not the per-layer list
            out["meta"] = {k: data.get(k) for k in ("source", "dtype", "size_bytes", "recipe", "report")}
        return _clean(out)
