"""`plan_report`: the JSON of `fewbits plan` (refusal of weights that cannot fit, the sweep), one function
for the command line and the web API."""

from __future__ import annotations

import pytest

from fewbits.cost import PlanError, plan
from fewbits.cost.report import plan_report


def test_weights_that_cannot_fit_are_refused_with_the_devices_they_need() -> None:
    # Llama-3.1-405B in BF16: ~405.9e9 weights x 2 bytes = ~812 GB; one H100 keeps 72 GB usable (10% headroom)
    # -> 812 / 72 = 11.3, so at least 12 devices
    with pytest.raises(PlanError, match=r"needs 81\d\.\d GB for its weights alone.*at least 12 devices"):
        plan_report("llama-3.1-405b", "h100")
    rep = plan_report("llama-3.1-405b", "h100", devices=12)
    assert rep.result.weights_fit and rep.data == rep.result.to_dict() and "sweep" not in rep.data


def test_sweep_points_are_plans() -> None:
    rep = plan_report("llama-3-8b", "h100", weights="int8", kv="fp8-e4m3", profile="seed",
                      sweep_axes={"batch": (1, 32), "context": (1024, 8192)})
    sw = rep.data["sweep"]
    assert sw["batch"] == [1, 32] and sw["context"] == [1024, 8192]
    for i, b in enumerate((1, 32)):
        for j, c in enumerate((1024, 8192)):
            p = plan("llama-3-8b", "h100", b, c, "int8", "fp8-e4m3", profile="seed", table_weights=None)
            assert sw["time_s"][i][j] == pytest.approx(p.time_s, rel=1e-12)
            assert sw["fits"][i][j] == p.fits
    assert rep.sweep_lines[1] == "sweep:" and any("compute-bound" in ln for ln in sw["summary"])
