"""What memory sampling costs the run, and when a costly reading is due.

The Accountant reads the allocator at every sample: it is cheap. Two readings are not: the
process and system figures (/proc files or psutil, and NVML on CUDA), and the census (a walk
over parameters and optimizer state). ``SamplingCost`` keeps the clocks of both and answers
"is one due now?" so that each stays under its budget, a fraction of the run's wall time;
it also states what sampling cost in all (summary.json's ``memory.accounting``).
"""

from __future__ import annotations

import math
from typing import Any


class SamplingCost:
    """The clocks of one Accountant's sampling, in perf_counter seconds.

    Args:
        t0: when the Accountant was made (the io budget's clock starts there).
        census_budget: after the always-sampled steps, the census is retaken only while the
            time spent on it stays under this fraction of the wall time since then.
        io_budget: fraction of the run's wall time that fresh process/system and NVML
            readings may take.

    Attributes:
        sampling_seconds: all time inside sampling (start_step, sample, the summary's reads).
        backend_seconds: of it, time inside backend.memory/census/reset_peak.
        census_seconds, census_calls: the census's share of backend_seconds, and its count.
        io_seconds, io_reads: time in fresh process/system and NVML readings, and their count.
    """

    def __init__(self, t0: float, census_budget: float = 0.0005, io_budget: float = 0.001):
        self.t0 = t0
        self.census_budget = float(census_budget)
        self.io_budget = float(io_budget)
        self.sampling_seconds = 0.0
        self.backend_seconds = 0.0
        self.census_seconds = 0.0
        self.census_calls = 0
        self.io_seconds = 0.0
        self.io_reads = 0
        self._io_cost = 0.0  # what the last fresh reading cost (NVML's part included)
        self._census_cost = math.inf  # what the last census cost
        self._warm_t: float | None = None  # when the first sample after step 2 began: census budget clock
        self._warm_census_s = 0.0  # census time since then

    def io_due(self, now: float) -> bool:
        """Whether a fresh process/system reading at ``now`` stays within io_budget, counting
        what the last one cost."""
        return self.io_seconds + self._io_cost <= self.io_budget * (now - self.t0)

    def io_read(self, seconds: float) -> None:
        """A fresh process/system reading took ``seconds``."""
        self._io_cost = seconds
        self.io_seconds += seconds
        self.io_reads += 1

    def nvml_read(self, seconds: float) -> None:
        """An NVML reading took ``seconds``: part of the fresh reading it came with."""
        self.io_seconds += seconds
        self._io_cost += seconds

    def census_due(self, step: int, now: float, always: bool) -> bool:
        """Whether to retake the census at ``step`` (``always``: none cached, or a step that is
        always sampled); after step 2 only while it stays within census_budget."""
        if step > 2 and self._warm_t is None:
            self._warm_t = now
        return always or (self._warm_t is not None
                          and self._warm_census_s + self._census_cost <= self.census_budget * (now - self._warm_t))

    def census_taken(self, seconds: float) -> None:
        """A census took ``seconds`` (inside the backend)."""
        self._census_cost = seconds
        self.census_seconds += seconds
        self.backend_seconds += seconds
        if self._warm_t is not None:
            self._warm_census_s += seconds
        self.census_calls += 1

    def report(self, per_sample_seconds: list[float], step_seconds_total: float) -> dict[str, Any]:
        """summary.json's ``memory.accounting``: the clocks, per-sample cost, and sampling as a
        fraction of the steps' wall time (``step_seconds_total``)."""
        n, per = len(per_sample_seconds), per_sample_seconds
        return {
            "sampling_seconds": self.sampling_seconds,
            "backend_seconds": self.backend_seconds,
            "own_seconds": self.sampling_seconds - self.backend_seconds,
            "census_seconds": self.census_seconds,
            "census_calls": self.census_calls,
            "io_seconds": self.io_seconds,
            "io_reads": self.io_reads,
            "io_budget": self.io_budget,
            "samples": n,
            "per_sample_us_mean": (sum(per) / n * 1e6) if n else None,
            "per_sample_us_max": (max(per) * 1e6) if n else None,
            "step_seconds_total": step_seconds_total,
            "fraction_of_step_time": (self.sampling_seconds / step_seconds_total) if step_seconds_total > 0 else None,
            "own_fraction_of_step_time": ((self.sampling_seconds - self.backend_seconds) / step_seconds_total
                                          if step_seconds_total > 0 else None),
        }
