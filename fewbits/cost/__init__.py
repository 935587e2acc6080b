"""The analytical cost model: what a format buys on a model and a device, before any weight is touched.

Pure Python + numpy; imports `fewbits.formats.format` and `fewbits.models.spec` only, never torch.

    >>> from fewbits.cost import plan, format_plan_text
    >>> r = plan("llama-3-8b", "h100", batch=16, context=4096, weights="int4-g128", kv="fp8-e4m3")
    >>> r.time_s, r.tokens_per_s, r.fits
"""

from fewbits.cost.devices import DEVICES, DeviceError, DeviceSpec, get_device
from fewbits.cost.plan import PlanError, PlanResult, TableRow, format_breakdown, format_plan_text, plan
from fewbits.cost.profile import (
    BUILTIN,
    DEFAULT,
    SEED,
    Profile,
    ProfileError,
    format_family,
    load_profile,
    save_profile,
)
from fewbits.cost.sweep import SweepResult, sweep

__all__ = [
    "DEVICES", "DeviceError", "DeviceSpec", "get_device", "PlanError", "PlanResult", "TableRow", "plan",
    "format_plan_text", "format_breakdown", "BUILTIN", "DEFAULT", "SEED", "Profile", "ProfileError",
    "format_family", "load_profile", "save_profile", "SweepResult", "sweep",
]
