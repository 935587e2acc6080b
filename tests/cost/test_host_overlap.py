"""A GPU's host queues work that runs meanwhile: a step takes max(host overheads, device time), not the sum."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fewbits.cost import DEFAULT, plan
from fewbits.cost.profile import Profile

ADD = replace(DEFAULT, name="add", overhead_s=5e-3)
OVERLAP = replace(ADD, name="overlap", host_overlap=True)


def test_overlap_takes_the_slower_of_host_and_device():
    # Llama-3-8B bf16 on an H100: ~16 GB of weights, several ms of device time
    add = plan("llama-3-8b", "h100", 1, 2048, "bf16", profile=ADD, table_weights=None)
    ovl = plan("llama-3-8b", "h100", 1, 2048, "bf16", profile=OVERLAP, table_weights=None)
    device = add.time_s - 5e-3
    assert device > 5e-3  # the weights take longer than the 5 ms of launches
    assert ovl.time_s == pytest.approx(device) and ovl.bound == "memory"
    # a small model: the 5 ms of launches set the step, whatever the format
    for w in ("bf16", "int4-g64"):
        small = plan("smollm2-135m", "h100", 1, 2048, w, profile=OVERLAP, table_weights=None)
        assert small.time_s == pytest.approx(5e-3) and small.bound == "host"
    assert plan("smollm2-135m", "h100", 1, 2048, "bf16", profile=ADD, table_weights=None).time_s > 5e-3


def test_host_overlap_round_trips_and_defaults_off():
    assert DEFAULT.host_overlap is False
    d = OVERLAP.to_dict()
    assert d["host_overlap"] is True and Profile.from_dict(d).host_overlap is True
