"""Wall-clock timing that holds up on a busy machine: warm-up, enough calls per sample, the fastest sample.

Other processes can only add time to a sample, never remove it, so the fastest of several samples is the
best estimate of the machine's own speed (`statistic="min"`, the default); "median" is available for
reporting typical times under load.  Side-by-side comparisons interleave the candidates round by round,
so a burst of load from another process hits all of them alike instead of one.

On a GPU the calls only queue work: pass `sync` (`fewbits.generate.synchronizer(device)`), which is
called after the warm-up and at the end of every sample before the clock is read, so that a sample
covers the work itself and not its launch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

STATS = {"min": min, "median": statistics.median}
#: untimed decode steps after each prefill before `fewbits bench` times any (`fewbits.bench.decode`): a last-level
#: cache takes a model's weights back over the first steps after anything else used it; two to five times the 6-10
#: steps a small model's step took to settle on a 2-core Emerald Rapids Xeon (a working set near the cache's size
#: takes up to ~30 passes, `fewbits.bench.machine.CURVE_PASSES`)
WARMUP_STEPS = 32


def _nothing() -> None:
    """The `sync` of a device whose calls return when their work is done (the CPU)."""


def time_call(fn: Callable[[], object], min_time: float = 0.05, rounds: int = 5, warmup: int = 2,
              statistic: str = "min", sync: Callable[[], object] | None = None) -> float:
    """Seconds per call of `fn`: the fastest (or median) of `rounds` samples of at least `min_time` s each."""
    return time_interleaved({"fn": fn}, min_time, rounds, warmup, statistic, sync)["fn"]


def time_interleaved(fns: dict[str, Callable[[], object]], min_time: float = 0.03, rounds: int = 7,
                     warmup: int = 2, statistic: str = "min", sync: Callable[[], object] | None = None
                     ) -> dict[str, float]:
    """Seconds per call for each of `fns` (fastest or median sample), sampled in alternation."""
    sync = sync or _nothing
    counts: dict[str, int] = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        counts[name] = max(1, int(min_time / max(time.perf_counter() - t0, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            n = counts[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            samples[name].append((time.perf_counter() - t0) / n)
    return {name: STATS[statistic](s) for name, s in samples.items()}
