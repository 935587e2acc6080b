"""`QuantizeReport`: what `fewbits.api.quantize` did, as text for people and a dict for fewbits.json."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class QuantizeReport:
    """What `quantize` did: sizes before/after, and every linear layer's fate."""

    size_before: int
    size_after: int
    layers: list[dict[str, Any]]
    seconds: float
    recipe: dict[str, Any]
    method_info: dict[str, Any] = field(default_factory=dict)
    #: what the calibrated methods were given (`CalibrationData.describe`, `describe_ids`), or None
    calibration: dict[str, Any] | None = None
    #: every method config used, all fields (a rule's options hold only those that differ from the defaults)
    method_configs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def quantized_layers(self) -> list[dict[str, Any]]:
        return [r for r in self.layers if r["action"] == "quantize"]

    @property
    def bits_per_weight(self) -> float | None:
        """Stored bits per weight over the quantised linear layers (scales and zeros included)."""
        q = self.quantized_layers
        n = sum(r["shape"][0] * r["shape"][1] for r in q)
        return 8 * sum(r["bytes_after"] for r in q) / n if n else None

    def to_dict(self) -> dict[str, Any]:
        return {"size_before": self.size_before, "size_after": self.size_after, "seconds": self.seconds,
                "bits_per_weight": self.bits_per_weight, "recipe": self.recipe, "layers": self.layers,
                "method_info": self.method_info, "method_configs": self.method_configs,
                "calibration": self.calibration}

    def text(self, max_lines: int = 12) -> str:
        """Sizes, counts per action and format, and every layer that was not treated as asked."""
        by: dict[str, int] = {}
        for r in self.layers:
            key = f"{r['action']} {r['format'] or '16-bit'}" + (f" ({r['method']})" if r["method"] else "")
            by[key] = by.get(key, 0) + 1
        ratio = self.size_before / self.size_after if self.size_after else float("nan")
        bpw = self.bits_per_weight
        lines = [f"model size: {self.size_before:,} bytes -> {self.size_after:,} bytes ({ratio:.2f}x smaller)"
                 + (f"; quantised linears {bpw:.3f} bits/weight" if bpw else ""),
                 "layers: " + ", ".join(f"{n} {k}" for k, n in by.items())]
        if self.calibration:
            c = self.calibration
            names = ", ".join(os.path.basename(t["name"]) for t in c.get("texts", []))
            lines.append(f"calibration: {c['source']}{f' ({names})' if names else ''}, "
                         f"{c['samples']} x {c['seq_len']} tokens")
        special = [r for r in self.layers if r["note"] and r["note"] not in ("ignore list", "no rule matches")]
        for r in special[:max_lines]:
            lines.append(f"  {r['name']}: {r['note']}")
        if len(special) > max_lines:
            lines.append(f"  ... and {len(special) - max_lines} more")
        ignored = [r["name"] for r in self.layers if r["action"] == "ignore"]
        if ignored:
            more = " ..." if len(ignored) > 6 else ""
            lines.append(f"  16-bit (ignore list / no rule): {', '.join(ignored[:6])}{more}")
        return "\n".join(lines)
