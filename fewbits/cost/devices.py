"""Accelerators as data: dense peak rates, memory, bandwidth and the link between devices.

All FLOP rates are DENSE (no 2:4 structured sparsity; vendors print sparse figures twice as large).
Units are SI: bytes, bytes/s, FLOP/s, seconds; "80 GB" means 80e9 bytes.  Link bandwidth is per
device and per direction (NVLink "900 GB/s" is bidirectional: 450 GB/s each way), which is what a
ring all-reduce moves.  Link latencies are typical small-message all-reduce latencies (NCCL/RCCL
tests report a few to tens of microseconds); they are estimates, not datasheet figures.

A measured profile (`fewbits.cost.profile`) can carry its own DeviceSpec that replaces these.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

T = 1e12
G = 1e9


class DeviceError(ValueError):
    """An unknown device or an inconsistent device description."""


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU socket).  peak_flops: precision -> dense FLOP/s ("bf16", "fp16",
    "fp8", "int8", "fp4"); a precision the chip has no units for is absent."""

    key: str
    name: str
    memory_bytes: float
    bandwidth: float
    peak_flops: dict[str, float] = field(default_factory=dict)
    link_bandwidth: float = 0.0
    link_latency: float = 0.0
    link: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.bandwidth <= 0:
            raise DeviceError(f"device {self.key!r}: memory and bandwidth must be positive")
        if "bf16" not in self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise DeviceError(f"device {self.key!r}: needs a positive 'bf16' peak, got {self.peak_flops}")

    def has(self, precision: str) -> bool:
        return precision in self.peak_flops

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "memory_bytes": self.memory_bytes, "bandwidth": self.bandwidth,
                "peak_flops": dict(self.peak_flops), "link_bandwidth": self.link_bandwidth,
                "link_latency": self.link_latency, "link": self.link, "source": self.source}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceSpec:
        try:
            return cls(key=str(d["key"]), name=str(d.get("name", d["key"])), memory_bytes=float(d["memory_bytes"]),
                       bandwidth=float(d["bandwidth"]),
                       peak_flops={str(k): float(v) for k, v in d["peak_flops"].items()},
                       link_bandwidth=float(d.get("link_bandwidth", 0.0)),
                       link_latency=float(d.get("link_latency", 0.0)), link=str(d.get("link", "")),
                       source=str(d.get("source", "")))
        except KeyError as e:
            raise DeviceError(f"device description lacks the field {e.args[0]!r}") from None


DEVICES: dict[str, DeviceSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5 column): BF16 1,979 / FP8 3,958 / INT8 3,958 TFLOPS
    # "with sparsity" -> halved; 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s.
    "h100-sxm": DeviceSpec("h100-sxm", "NVIDIA H100 SXM 80GB", 80 * G, 3.35 * T,
                           {"bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1978.9 * T, "int8": 1978.9 * T},
                           450 * G, 8e-6, "NVLink 4", "NVIDIA H100 datasheet (SXM)"),
    # Same datasheet, PCIe column: BF16 1,513 / FP8 3,026 sparse; 80 GB HBM2e at 2.0 TB/s; NVLink bridge
    # 600 GB/s (pairs only) -> 300 GB/s each way.
    "h100-pcie": DeviceSpec("h100-pcie", "NVIDIA H100 PCIe 80GB", 80 * G, 2.0 * T,
                            {"bf16": 756.5 * T, "fp16": 756.5 * T, "fp8": 1513 * T, "int8": 1513 * T},
                            300 * G, 10e-6, "NVLink bridge", "NVIDIA H100 datasheet (PCIe)"),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): same tensor cores as H100 SXM; 141 GB HBM3e at 4.8 TB/s.
    # Measured on one (`fewbits probe --device cuda`, torch 2.11): a device copy moved 4.31-4.39 TB/s (read +
    # write), 0.90-0.92 of this; 8192-cube GEMMs ran bf16 710-723 TFLOP/s (0.72), fp8 _scaled_mm 1309-1328
    # (0.67); a bf16 14336 x 4096 GEMV 3.47 TB/s (0.72).
    "h200": DeviceSpec("h200", "NVIDIA H200 SXM 141GB", 141 * G, 4.8 * T,
                       {"bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1978.9 * T, "int8": 1978.9 * T},
                       450 * G, 8e-6, "NVLink 4", "NVIDIA H200 datasheet (SXM)"),
    # NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS, INT8 624 TOPS dense (no FP8 units);
    # 80 GB HBM2e at 2,039 GB/s (SXM); NVLink 3 600 GB/s.
    "a100-80gb": DeviceSpec("a100-80gb", "NVIDIA A100 SXM 80GB", 80 * G, 2.039 * T,
                            {"bf16": 312 * T, "fp16": 312 * T, "int8": 624 * T},
                            300 * G, 8e-6, "NVLink 3", "NVIDIA A100 datasheet (80GB SXM)"),
    # Same datasheet: 40 GB HBM2 at 1,555 GB/s.
    "a100-40gb": DeviceSpec("a100-40gb", "NVIDIA A100 SXM 40GB", 40 * G, 1.555 * T,
                            {"bf16": 312 * T, "fp16": 312 * T, "int8": 624 * T},
                            300 * G, 8e-6, "NVLink 3", "NVIDIA A100 datasheet (40GB)"),
    # NVIDIA HGX B200 datasheet, per GPU (eight-GPU figures / 8, sparse halved): FP4 9 PF, FP8/INT8
    # 4.5 PF, BF16 2.25 PF; 180 GB HBM3e at 8 TB/s; NVLink 5 1.8 TB/s.
    "b200": DeviceSpec("b200", "NVIDIA B200 180GB", 180 * G, 8.0 * T,
                       {"bf16": 2250 * T, "fp16": 2250 * T, "fp8": 4500 * T, "int8": 4500 * T, "fp4": 9000 * T},
                       900 * G, 8e-6, "NVLink 5", "NVIDIA HGX B200 datasheet"),
    # AMD Instinct MI300X data sheet: FP16/BF16 1,307.4 TFLOPS, FP8 2,614.9, INT8 2,614.9 TOPS dense;
    # 192 GB HBM3 at 5.3 TB/s; Infinity Fabric 7 links x 64 GB/s each way = 448 GB/s.
    "mi300x": DeviceSpec("mi300x", "AMD Instinct MI300X 192GB", 192 * G, 5.3 * T,
                         {"bf16": 1307.4 * T, "fp16": 1307.4 * T, "fp8": 2614.9 * T, "int8": 2614.9 * T},
                         448 * G, 12e-6, "Infinity Fabric", "AMD Instinct MI300X data sheet"),
    # NVIDIA L40S datasheet: BF16 362.05 / FP8 733 / INT8 733 dense; 48 GB GDDR6 at 864 GB/s; PCIe Gen4
    # x16 (64 GB/s bidirectional).
    "l40s": DeviceSpec("l40s", "NVIDIA L40S 48GB", 48 * G, 864 * G,
                       {"bf16": 362.05 * T, "fp16": 362.05 * T, "fp8": 733 * T, "int8": 733 * T},
                       32 * G, 20e-6, "PCIe Gen4 x16", "NVIDIA L40S datasheet"),
    # NVIDIA L4 datasheet: BF16 121 / FP8 242.5 / INT8 242.5 dense (242/485/485 with sparsity);
    # 24 GB GDDR6 at 300 GB/s; PCIe Gen4 x16.
    "l4": DeviceSpec("l4", "NVIDIA L4 24GB", 24 * G, 300 * G,
                     {"bf16": 121 * T, "fp16": 121 * T, "fp8": 242.5 * T, "int8": 242.5 * T},
                     32 * G, 20e-6, "PCIe Gen4 x16", "NVIDIA L4 datasheet"),
    # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090 column, FP32 accumulate): BF16 165.2,
    # FP8 330.3, INT8 660.6 dense; 24 GB GDDR6X at 1,008 GB/s; PCIe Gen4 x16 (no NVLink).
    "rtx4090": DeviceSpec("rtx4090", "NVIDIA GeForce RTX 4090 24GB", 24 * G, 1008 * G,
                          {"bf16": 165.2 * T, "fp16": 165.2 * T, "fp8": 330.3 * T, "int8": 660.6 * T},
                          32 * G, 20e-6, "PCIe Gen4 x16", "NVIDIA Ada Lovelace architecture whitepaper"),
    # Intel Xeon Platinum 8480+ (Sapphire Rapids) product brief: 56 cores, 8 channels DDR5-4800
    # (8 x 38.4 GB/s = 307.2 GB/s); AMX tiles: 1,024 BF16 / 2,048 INT8 ops per cycle per core at the
    # 2.0 GHz base clock -> 114.7 TFLOPS BF16, 229.4 TOPS INT8.  Memory: a 512 GB configuration (assumed).
    "cpu": DeviceSpec("cpu", "Intel Xeon Platinum 8480+ (1 socket, AMX)", 512 * G, 307.2 * G,
                      {"bf16": 114.7 * T, "fp16": 114.7 * T, "int8": 229.4 * T},
                      20 * G, 10e-6, "UPI", "Intel Xeon 8480+ product brief; DDR5-4800 JEDEC rate"),
}

ALIASES: dict[str, str] = {
    "h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h100sxm": "h100-sxm", "h200-sxm": "h200",
    "a100": "a100-80gb", "a100-80": "a100-80gb", "a100-40": "a100-40gb", "4090": "rtx4090",
    "rtx-4090": "rtx4090", "mi300": "mi300x", "xeon": "cpu",
}


def get_device(name: str | DeviceSpec) -> DeviceSpec:
    """A device from the table (case-insensitive, aliases such as 'h100' accepted)."""
    if isinstance(name, DeviceSpec):
        return name
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in DEVICES:
        close = difflib.get_close_matches(key, list(DEVICES) + list(ALIASES), n=3, cutoff=0.4)
        hint = f"did you mean {', '.join(dict.fromkeys(ALIASES.get(c, c) for c in close))}? " if close else ""
        raise DeviceError(f"unknown device {name!r}; {hint}known: {', '.join(sorted(DEVICES))}")
    return DEVICES[key]
