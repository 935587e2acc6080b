"""Timing helpers: a sample must cover the work a call queued, not only its launch (GPU semantics)."""

from __future__ import annotations

import time

import pytest

from fewbits.bench.timing import time_call, time_interleaved


class QueuedDevice:
    """Calls only queue work (as on a GPU); `sync` performs it: 2 ms per queued call."""

    def __init__(self) -> None:
        self.queued = 0
        self.syncs = 0

    def call(self) -> None:
        self.queued += 1

    def sync(self) -> None:
        self.syncs += 1
        time.sleep(2e-3 * self.queued)
        self.queued = 0


def test_time_call_counts_the_work_a_sync_waits_for():
    dev = QueuedDevice()
    t = time_call(dev.call, min_time=0.0, rounds=3, warmup=2, sync=dev.sync)
    assert t >= 2e-3  # the queued work, not the ~0.1 us of queuing it
    assert dev.queued == 0 and dev.syncs == 1 + 1 + 3  # after warm-up, after the probe call, per sample
    assert time_call(QueuedDevice().call, min_time=0.0, rounds=3) < 1e-3  # without sync: launch time only


def test_time_interleaved_syncs_every_sample():
    a, b = QueuedDevice(), QueuedDevice()
    both = QueuedDevice()

    def sync() -> None:  # one device: both candidates' work is waited for by the same sync
        both.queued = a.queued + b.queued
        a.queued = b.queued = 0
        both.sync()

    t = time_interleaved({"a": a.call, "b": b.call}, min_time=0.0, rounds=4, warmup=1, sync=sync)
    assert t["a"] >= 2e-3 and t["b"] >= 2e-3
    assert both.syncs == 2 * 2 + 2 * 4  # per candidate after warm-up and probe call, then every sample


@pytest.mark.parametrize("statistic", ["min", "median"])
def test_statistics_of_plain_cpu_calls(statistic):
    t = time_call(lambda: time.sleep(1e-3), min_time=0.0, rounds=3, warmup=0, statistic=statistic)
    assert 1e-3 <= t < 0.5
