"""The Accountant: samples memory at the phases of a step and keeps the timeline.

One sample is a flat dict; every memory figure is an int of bytes, or None where the source
cannot measure it. Keys (allocator figures summed over this process's devices):

- where: ``index`` (sequence number of the sample), ``step`` (0 = after load), ``phase`` (load,
  forward, backward, optimizer), ``micro`` (nth sample of this step and phase: one per
  micro-batch under gradient accumulation), ``time_s`` (since the Accountant was made),
  ``backend``, ``host``, ``rank``.
- allocator: ``allocated``, ``reserved`` (torch reserved; MLX active + cache),
  ``step_peak_allocated``/``step_peak_reserved`` (the backend's peak since ``start_step`` of
  this step reset it; ``peak_scope`` says "step", or "since_load"/"since_reset" where no reset
  happened this step), ``peak_allocated``/``peak_reserved`` (run peak: max over every backend
  peak read since the run started, unsampled steps included; where the backend keeps no peak
  counter, e.g. MLX reserved, the largest sampled value), backend extras passed through
  (cuda: ``inactive_split`` bytes, ``alloc_retries``/``num_ooms`` counts; mlx: ``mlx_active``,
  ``mlx_cache``, ``mlx_peak``, ``mlx_memory_limit``, ``mlx_cache_limit``, ``mlx_wired_limit``,
  ``mlx_recommended_working_set``).
- device (NVML, CUDA only): ``device_total``, ``device_used``, ``process_device_used``,
  ``other_processes_used``, ``non_allocator`` = device_used - reserved, its known parts
  ``paged_optimizer_state`` (census), ``cuda_context`` (backend), ``other_processes_used``,
  and ``non_allocator_unexplained``; ``devices``: the same per device.
- process and system: ``rss``, ``peak_rss``, ``swap_process``, ``swap_used``, ``swap_total``,
  ``swap_growth`` (swap_used minus its value when the Accountant was made), ``system_total``,
  ``system_available``, ``psi_some_avg10``/``psi_full_avg10`` (percent, Linux),
  ``pressure_level`` (macOS). These come from /proc (or psutil) and are read afresh only at
  the load and optimizer phases, and there only while the time spent reading them stays under
  ``io_budget`` of the run's wall time (always at steps 0-2); otherwise the sample repeats the
  last fresh reading and ``system_fresh`` is False. NVML (CUDA) follows the same rule: between
  readings a sample carries each device's last NVML figures and the non-allocator gap as it was
  then. Allocator figures are read at every sample; the kernel's RSS high-water mark keeps
  ``peak_rss`` exact between readings.
- ``census``: bytes by category from backend.census(), plus ``activations_and_other`` =
  allocated - allocator-held categories; ``census_step``: the step it was taken at (the census
  is structural; after step 2 it is retaken within a time budget, see ``census_budget``).
- ``sample_seconds``: what taking this sample cost; ``memory_error``: present when
  backend.memory() raised (the sample then has no allocator figures; training goes on).
"""

from __future__ import annotations

import math
import socket
import time
from pathlib import Path
from typing import Any, cast

from finetune.accounting.cost import SamplingCost
from finetune.accounting.probes import NON_ALLOCATOR_PARTS, NvmlProbe, SystemProbe, reconcile_nvml
from finetune.accounting.rules import explain as explain_samples
from finetune.units import fmt_bytes, fmt_delta
from finetune.accounting.render import device_title, render_table, write_plot
from finetune.backends import capabilities
from finetune.records import ACTIVATIONS_AND_OTHER, ALLOCATOR_HELD, CENSUS_KEYS, Census, MemoryReading, Sample  # noqa: F401  (CENSUS_KEYS: re-exported)

_MEMORY_STD = {"allocated", "reserved", "peak_allocated", "peak_reserved", "device_total", "devices",
               "cuda_context"}
COUNT_KEYS = {"alloc_retries", "num_alloc_retries", "num_ooms", "ooms", "major_faults"}  # counts, not bytes
_FLOAT_KEYS = {"psi_some_avg10", "psi_full_avg10"}
_ALWAYS_SAMPLED = (0, 1, 2)  # load, and the two steps whose difference shows lazy allocations
# what a device row takes from an NVML reading (kept per device, carried between readings)
_NVML_KEYS = ("device_used", "process_device_used", "other_processes_used", "non_allocator",
              "non_allocator_unexplained")


def _int(v: Any) -> int | None:
    if type(v) is int:  # the common case, first: this runs ~30 times per sample
        return v
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, float) and not math.isfinite(v):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _max(*vals: int | None) -> int | None:
    known = [v for v in vals if v is not None]
    return max(known) if known else None


def _sum(vals: list[int | None]) -> int | None:
    """Sum, or None if any part is unknown (a partial sum would pass for a measurement)."""
    if not vals or any(v is None for v in vals):
        return None
    return sum(vals)  # type: ignore[arg-type]


class Accountant:
    """Samples memory figures at the phases of each step and explains them.

    Args:
        backend: a backends.base.Backend (memory(), census(), reset_peak(), name).
        sample_every: sample steps whose number is a multiple of this; steps 0 (load), 1 and 2
            are always sampled; 0 turns sampling off.
        device_index: the CUDA device index of a single-device run (NVML lookup); None: 0, or
            the per-device list the backend's memory() gives.
        census_budget: after step 2 the census (a walk over parameters and optimizer state) is
            retaken at a phase only while the time spent on it stays under this fraction of
            the run's wall time; otherwise the phase's previous census is reused (it is
            structural: sizes change only when the model or optimizer does) and the sample's
            ``census_step`` says which step it is from.
        rank: this process's rank in a distributed run (recorded in each sample).
        io_budget: fraction of the run's wall time that fresh process/system readings (/proc
            files, psutil) and NVML readings may take. On a model whose steps take a second
            every optimizer-phase sample reads them; on the tiny model, whose steps take
            milliseconds, every few steps (the first system call after a burst of computation
            can cost 100 us or more on a virtualised host).
        max_samples: bound on the timeline kept in memory (a sample is a few KB). Past it, the
            older half is thinned: steps 0-2 and the recent half stay whole, older steps keep
            only every other optimizer-phase sample. Run peaks are tracked apart and stay exact.
    """

    def __init__(self, backend: Any, sample_every: int = 1, device_index: int | None = None,
                 census_budget: float = 0.0005, rank: int = 0, max_samples: int = 20_000,
                 io_budget: float = 0.001, phase_every: int = 10):
        self.backend = backend
        self.backend_name = str(getattr(backend, "name", "unknown"))
        # whether the device has a driver view (NVML) to read beside the allocator: the
        # backend's capabilities say so (a stand-in backend in tests has none)
        try:
            self._caps_nvml = capabilities(self.backend_name).nvml
        except Exception:
            self._caps_nvml = False
        self.sample_every = int(sample_every)
        # forward/backward samples after step 2 only on every phase_every-th step (1: every
        # sampled step). Peaks stay exact: the optimizer-phase sample reads the allocator's
        # peak counters, which cover the whole step since start_step reset them.
        self.phase_every = max(1, int(phase_every))
        # the step whose optimizer-phase sample was the last allocator read, with nothing run
        # on the device since (the loop says when an evaluation or a checkpoint ran between
        # steps): start_step then resets the peak counters without reading them first
        self._clean_after: int | None = None
        self.device_index = device_index
        self.rank = rank
        self.max_samples = max(100, int(max_samples))
        self.thinned = 0  # samples dropped from the timeline by thinning
        self.host = socket.gethostname()
        # dicts, and raw records of inner-phase samples not yet built (see sample())
        self._timeline: list[dict[str, Any]] = []
        self._pending_from: int | None = None  # index of the first raw record, if any
        self._t0 = time.perf_counter()
        # what sampling costs, and whether a census or a fresh system reading is due
        self.cost = SamplingCost(self._t0, census_budget=census_budget, io_budget=io_budget)
        self._sys = SystemProbe()
        self._nvml = NvmlProbe()
        first = self._sys.read()
        self._swap_base: int | None = first["swap_used"]
        # samples taken so far in the current step, by phase (the step's micro-batch index);
        # cleared when the step changes: keyed by (step, phase) for the whole run it grew by
        # ~180 B a step without bound (measured by the soak, benchmarks/soak.py)
        self._micro: dict[str, int] = {}
        self._micro_step: int | None = None
        self._reset_step: int | None = None
        self._ever_reset = False
        self._run_peak: dict[str, int | None] = {"allocated": None, "reserved": None}
        self._run_peak_at: dict[str, dict[str, Any] | None] = {"allocated": None, "reserved": None}
        self._dev_peak: dict[int, dict[str, int | None]] = {}
        self._nvml_last: dict[int, dict[str, Any]] = {}  # device index -> its last NVML figures
        self._census_cache: dict[str, tuple[int, dict[str, int | None], int | None]] = {}
        # torch on CPU: memory() reports no allocator figure; once steps 0-2 showed that, the
        # device will not change mid-run, so it is not asked again (its call can cost 100s of us)
        self._no_allocator: bool | None = None
        self._end_peak_rss: int | None = None
        # the last sample built in full, and what it was built from (see sample())
        self._base: dict[str, Any] | None = None
        self._base_census: Any = None
        self._base_metrics: dict[str, Any] | None = None
        self._derived: dict[str, Any] | None = None
        self._mem_none = MemoryReading()
        # what the run tells the rules beside the samples: the governor's actions
        # ("adaptations", the same list summary.json keeps), "adapt", "budget_set"
        self.run_facts: dict[str, Any] = {}

    # -- sampling ----------------------------------------------------------------------------
    def will_sample(self, step: int) -> bool:
        """Whether ``step`` is sampled (the same answer for every phase of it)."""
        if self.sample_every <= 0:
            return False
        return step in _ALWAYS_SAMPLED or step % self.sample_every == 0

    def start_step(self, step: int) -> None:
        """Call before the step's first forward: resets the backend's peak counters so the
        step's samples carry the step-scope peak. The peak since the previous reset (which
        covers any unsampled steps in between) is folded into the run peak first."""
        if not self.will_sample(step) or self._no_allocator:
            return
        t0 = time.perf_counter()
        try:
            if self._clean_after == step - 1:
                # the last optimizer-phase sample already read these counters and the device
                # ran nothing since: nothing to fold, only the reset
                t1 = t2 = time.perf_counter()
            else:
                # peaks() where the backend has it: two counters instead of every memory figure
                peaks = getattr(self.backend, "peaks", None)
                mem: MemoryReading = peaks() if peaks is not None else (self.backend.memory() or MemoryReading())
                t1 = time.perf_counter()
                self._fold_peaks(mem, step - 1, "before_step_" + str(step))
                t2 = time.perf_counter()
            self.backend.reset_peak()
            self._reset_step, self._ever_reset = step, True
        finally:
            t3 = time.perf_counter()
            self.cost.sampling_seconds += t3 - t0
            self.cost.backend_seconds += (t1 - t0) + (t3 - t2)

    @property
    def samples(self) -> list[dict[str, Any]]:
        """The timeline, oldest first (samples taken inside a step on a single-device backend
        are stored raw and built into dicts here, on first read)."""
        if self._pending_from is not None:
            self._materialize()
        return self._timeline

    @samples.setter
    def samples(self, value: list[dict[str, Any]]) -> None:
        self._timeline, self._pending_from = list(value), None

    @property
    def sampling_seconds(self) -> float:
        """Seconds spent sampling so far (``cost``: every clock of it)."""
        return self.cost.sampling_seconds

    @property
    def io_seconds(self) -> float:
        """Of sampling_seconds: fresh process/system and NVML readings."""
        return self.cost.io_seconds

    @property
    def io_reads(self) -> int:
        """Fresh process/system readings taken so far."""
        return self.cost.io_reads

    def sample(self, step: int, phase: str) -> Sample | None:
        """Take a sample at ``phase`` of ``step`` and append it to the timeline.

        Inside a step (forward/backward) on a single-device backend without NVML (MLX, CPU)
        only the figures themselves are read now; the sample dict is built when the timeline
        is next read (the figures are the same, building later keeps the step's hot path
        short). Load and optimizer samples, and every sample on CUDA, are built at once.

        Returns:
            The sample, or None when this step is not sampled or the sample was stored raw.
        """
        if not self.will_sample(step):
            return None
        inner = phase in ("forward", "backward")
        if inner and step not in _ALWAYS_SAMPLED and step % self.phase_every:
            return None  # phases after step 2 every phase_every-th step (see __init__)
        self._clean_after = step if phase == "optimizer" else None
        if self._no_allocator and inner:
            # No allocator to read (torch on CPU) and the system figures are reused inside a
            # step: such a sample would repeat the last one, so it is not taken.
            return None
        t0 = time.perf_counter()
        if step != self._micro_step:
            self._micro.clear()
            self._micro_step = step
        micro = self._micro.get(phase, 0)
        self._micro[phase] = micro + 1
        mem = self._memory(step)
        scope = "step" if self._reset_step == step else ("since_reset" if self._ever_reset else "since_load")
        self._fold_peaks(mem, step, phase)
        census = self._census(step, phase)
        fresh = not inner and (step in _ALWAYS_SAMPLED or self.cost.io_due(t0))
        if fresh:
            t_io = time.perf_counter()
            sysr = self._sys.read(fresh=True)
            self.cost.io_read(time.perf_counter() - t_io)  # NVML adds its part in _devices
        else:
            sysr = self._sys.read(fresh=False)
        raw = [len(self._timeline), step, phase, micro, t0 - self._t0, mem, scope, self._run_peak["allocated"],
               self._run_peak["reserved"], census, sysr, fresh, 0.0]
        if inner and not mem.get("devices") and not (self._caps_nvml and self._nvml.ok is not False
                                                     and mem.get("allocated") is not None):
            dt = time.perf_counter() - t0
            raw[-1] = dt
            self.cost.sampling_seconds += dt
            if self._pending_from is None:
                self._pending_from = len(self._timeline)
            self._timeline.append(raw)  # type: ignore[arg-type]
            return None
        base = self._base
        if (self._no_allocator and not fresh and base is not None and census is self._base_census
                and not inner):
            # Nothing to read has moved (no allocator; process and system figures not due; the
            # same census): the last built sample with this one's place in the timeline.
            s = dict(base)
            s.update(index=raw[0], step=step, phase=phase, micro=micro, time_s=raw[4], peak_scope=scope,
                     system_fresh=False)
            self._derived = s
        else:
            s = self._build(raw)
            self._base, self._base_census, self._base_metrics, self._derived = s, census, None, None
        dt = time.perf_counter() - t0
        s["sample_seconds"] = dt
        self.cost.sampling_seconds += dt
        self._timeline.append(s)
        if len(self._timeline) > self.max_samples:
            self._thin()
        return cast(Sample, s)  # the keys finetune.records.Sample lists

    def _materialize(self) -> None:
        t0 = time.perf_counter()
        tl = self._timeline
        for i in range(self._pending_from or 0, len(tl)):
            if isinstance(tl[i], list):
                t1 = time.perf_counter()
                s = self._build(tl[i])  # type: ignore[arg-type]
                s["sample_seconds"] = tl[i][-1] + (time.perf_counter() - t1)  # type: ignore[index]
                tl[i] = s
        self._pending_from = None
        self.cost.sampling_seconds += time.perf_counter() - t0
        if len(tl) > self.max_samples:
            self._thin()

    def _build(self, raw: list[Any]) -> dict[str, Any]:
        """The sample dict from what sample() read (see the module docstring for its keys)."""
        index, step, phase, micro, t, mem, scope, run_alloc, run_res, census, sysr, fresh, _ = raw
        alloc, reserved = _int(mem.get("allocated")), _int(mem.get("reserved"))
        s: dict[str, Any] = {
            "index": index, "step": step, "phase": phase, "micro": micro,
            "time_s": t, "backend": self.backend_name, "host": self.host, "rank": self.rank,
            "allocated": alloc, "reserved": reserved,
            "step_peak_allocated": _int(mem.get("peak_allocated")),
            "step_peak_reserved": _int(mem.get("peak_reserved")),
            "peak_scope": scope, "peak_allocated": run_alloc, "peak_reserved": run_res,
        }
        for k, v in mem.items():  # backend extras: mlx_*, inactive_split, alloc_retries, ...
            if k not in _MEMORY_STD and k not in s:
                s[k] = v if (isinstance(v, float) and k in _FLOAT_KEYS) or k == "memory_error" else _int(v)
        if census:
            c = dict(census[1])
            held = census[2]
            c["activations_and_other"] = alloc - held if alloc is not None and held is not None else None
            s["census"], s["census_step"] = c, census[0]
        else:
            c = {"activations_and_other": None}
            s["census"], s["census_step"] = c, None
        s.update(sysr)
        s["system_fresh"] = fresh
        if self._swap_base is None:
            self._swap_base = s["swap_used"]
        s["swap_growth"] = (s["swap_used"] - self._swap_base
                            if s["swap_used"] is not None and self._swap_base is not None else None)
        self._devices(s, mem, c, fresh=fresh)
        return s

    def _thin(self) -> None:
        if self._pending_from is not None:
            self._materialize()  # thins again at its end if still needed
            return
        keep_recent = self.max_samples // 2
        old, recent = self._timeline[:-keep_recent], self._timeline[-keep_recent:]
        kept, nth = [], 0
        for s in old:
            if s["step"] in _ALWAYS_SAMPLED:
                kept.append(s)
            elif s["phase"] == "optimizer":
                nth += 1
                if nth % 2:
                    kept.append(s)
        self.thinned += len(self._timeline) - len(kept) - len(recent)
        self._timeline = kept + recent

    def _memory(self, step: int) -> MemoryReading:
        if self._no_allocator:
            return self._mem_none
        t0 = time.perf_counter()
        try:
            mem = self.backend.memory() or MemoryReading()
        except Exception as e:  # a report must not stop training: this sample says what failed
            mem = MemoryReading(memory_error=f"{type(e).__name__}: {e}")
        self.cost.backend_seconds += time.perf_counter() - t0
        silent = all(mem.get(k) is None for k in ("allocated", "reserved", "peak_allocated")) and not mem.get("devices")
        if not silent:
            self._no_allocator = False
        elif step > 2 and self._no_allocator is None and "memory_error" not in mem:
            self._no_allocator, self._mem_none = True, mem
        return mem

    def between_steps(self) -> None:
        """The loop ran something on the device between two steps (an evaluation, a
        checkpoint): the next start_step reads the peak counters before resetting them."""
        self._clean_after = None

    def invalidate_census(self) -> None:
        """Retake the census at the next sample (call after changing the model or optimizer)."""
        self._census_cache.clear()

    def _fold_peaks(self, mem: MemoryReading, step: int, phase: str) -> None:
        for name, pname in (("allocated", "peak_allocated"), ("reserved", "peak_reserved")):
            cand = _max(_int(mem.get(pname)), _int(mem.get(name)))
            cur = self._run_peak[name]
            if cand is not None and (cur is None or cand > cur):
                self._run_peak[name] = cand
                self._run_peak_at[name] = {"step": step, "phase": phase}

    def _census(self, step: int, phase: str) -> tuple[int, dict[str, int | None], int | None] | None:
        """(step taken, bytes by category, sum of the allocator-held categories or None)."""
        cached = self._census_cache.get(phase)
        t0 = time.perf_counter()
        if not self.cost.census_due(step, t0, always=cached is None or step in _ALWAYS_SAMPLED):
            return cached
        try:
            raw = self.backend.census() or {}
        except Exception:  # a census is a report; a backend mid-change must not stop training
            return cached
        self.cost.census_taken(time.perf_counter() - t0)
        cats = {k: _int(v) for k, v in raw.items()}
        held = [cats.get(k) for k in ALLOCATOR_HELD]
        got = (step, cats, None if None in held else sum(held))  # type: ignore[arg-type]
        self._census_cache[phase] = got
        return got

    def _devices(self, s: dict[str, Any], mem: MemoryReading, census: dict[str, Any], fresh: bool) -> None:
        """Per-device rows with NVML beside the allocator, and their process-wide sums. NVML is
        read when ``fresh`` (the sample's process/system readings are due) or on a device's
        first sample; otherwise its last reading is carried."""
        rows_in = mem.get("devices")
        use_nvml = self._caps_nvml and s["allocated"] is not None and self._nvml.ok is not False
        paged = _int(census.get("optimizer_state_paged"))
        if not use_nvml and not rows_in:  # MLX, CPU: one row, no NVML (the common cheap path)
            idx = self.device_index or 0
            total, ctx = _int(mem.get("device_total")), _int(mem.get("cuda_context"))
            s["devices"] = [{"index": idx, "allocated": s["allocated"], "reserved": s["reserved"],
                             "peak_allocated": s["step_peak_allocated"], "peak_reserved": s["step_peak_reserved"],
                             "device_total": total, "cuda_context": ctx, "device_used": None,
                             "process_device_used": None, "other_processes_used": None,
                             "paged_optimizer_state": paged, "non_allocator": None,
                             "non_allocator_unexplained": None}]
            pk = self._dev_peak.setdefault(idx, {"allocated": None, "reserved": None, "device_used": None})
            pk["allocated"] = _max(pk["allocated"], s["step_peak_allocated"], s["allocated"])
            pk["reserved"] = _max(pk["reserved"], s["step_peak_reserved"], s["reserved"])
            s.update(device_total=total, device_used=None, process_device_used=None, other_processes_used=None,
                     cuda_context=ctx, paged_optimizer_state=paged, non_allocator=None,
                     non_allocator_unexplained=None)
            return
        if not isinstance(rows_in, list) or not rows_in:
            rows_in = [{"index": self.device_index or 0, "allocated": s["allocated"], "reserved": s["reserved"],
                        "peak_allocated": s["step_peak_allocated"], "peak_reserved": s["step_peak_reserved"],
                        "device_total": mem.get("device_total"), "cuda_context": mem.get("cuda_context")}]
        rows = []
        for d in rows_in:
            idx = int(d.get("index", 0))
            r: dict[str, Any] = {"index": idx}
            for k in ("allocated", "reserved", "peak_allocated", "peak_reserved", "device_total", "cuda_context"):
                r[k] = _int(d.get(k))
            if r["cuda_context"] is None and len(rows_in) == 1:
                r["cuda_context"] = _int(mem.get("cuda_context"))
            r["paged_optimizer_state"] = paged if len(rows_in) == 1 else None
            last = self._nvml_last.get(idx)
            if use_nvml and (fresh or last is None):
                t_nv = time.perf_counter()
                nv = self._nvml.read(idx, d.get("pci_bus_id"), processes=True, uuid=d.get("uuid"))
                self.cost.nvml_read(time.perf_counter() - t_nv)
                if r["device_total"] is None:
                    r["device_total"] = nv.get("device_total")
                r["device_used"] = nv.get("device_used")
                r["process_device_used"] = nv.get("process_used")
                r["other_processes_used"] = nv.get("other_processes_used")
                _split_non_allocator(r)
                self._nvml_last[idx] = {k: r[k] for k in ("device_total", *_NVML_KEYS)}
            elif use_nvml and last is not None:  # (always, when use_nvml: see the branch above)
                # NVML not due (see io_budget): the last reading, with the gap as it was then
                # (from NVML's used and the reserved bytes of that moment)
                r.update((k, last[k]) for k in _NVML_KEYS)
                if r["device_total"] is None:
                    r["device_total"] = last["device_total"]
            else:
                r.update(device_used=None, process_device_used=None, other_processes_used=None)
                _split_non_allocator(r)
            rows.append(r)
            pk = self._dev_peak.setdefault(idx, {"allocated": None, "reserved": None, "device_used": None})
            pk["allocated"] = _max(pk["allocated"], r["peak_allocated"], r["allocated"])
            pk["reserved"] = _max(pk["reserved"], r["peak_reserved"], r["reserved"])
            pk["device_used"] = _max(pk["device_used"], r["device_used"])
        s["devices"] = rows
        s["device_total"] = _int(mem.get("device_total")) if len(rows) == 1 and mem.get("device_total") is not None \
            else _sum([r["device_total"] for r in rows])
        for k in ("device_used", "process_device_used", "other_processes_used", "cuda_context"):
            s[k] = _sum([r[k] for r in rows])
        s["paged_optimizer_state"] = paged
        if fresh or not use_nvml:
            tot = {"device_used": s["device_used"], "reserved": s["reserved"], "paged_optimizer_state": paged,
                   "cuda_context": s["cuda_context"], "other_processes_used": s["other_processes_used"]}
            _split_non_allocator(tot)
            s["non_allocator"], s["non_allocator_unexplained"] = tot["non_allocator"], tot["non_allocator_unexplained"]
        else:  # as of each device's last NVML reading
            s["non_allocator"] = _sum([r["non_allocator"] for r in rows])
            s["non_allocator_unexplained"] = _sum([r["non_allocator_unexplained"] for r in rows])

    # -- outputs -----------------------------------------------------------------------------
    def _latest(self) -> dict[str, Any] | None:
        """The newest sample, without building the raw ones before it."""
        if not self._timeline:
            return None
        if isinstance(self._timeline[-1], list):
            self._materialize()
        return self._timeline[-1]

    def metrics_fields(self) -> dict[str, Any]:
        """Flat fields of the latest sample for one metrics.jsonl line: ``*_bytes`` ints or
        None (-> null), counts and percents without the suffix."""
        s = self._latest()
        if s is None:
            return {}
        if s is self._derived and self._base_metrics is not None:
            # a copy of the base sample: only the fields that differ from the base's line move
            m = dict(self._base_metrics)
            m["memory_step"], m["memory_phase"] = s["step"], s["phase"]
            m["memory_sample_us"] = s["sample_seconds"] * 1e6
            return m
        m = metrics_fields(s)
        if s is self._base:
            self._base_metrics = m
        return m

    def progress_text(self) -> str:
        """Short memory status for the progress bar, e.g.
        "alloc 1.23 GiB | peak 1.50 GiB | rss 2.10 GiB | swap +0 B"."""
        s = self._latest()
        if s is None:
            return "mem n/a"
        parts = []
        if s.get("allocated") is not None:
            parts.append(f"alloc {fmt_bytes(s['allocated'])}")
        if s.get("peak_allocated") is not None:
            parts.append(f"peak {fmt_bytes(s['peak_allocated'])}")
        if s.get("device_used") is not None:
            parts.append(f"nvml {fmt_bytes(s['device_used'])}")
        if s.get("rss") is not None:
            parts.append(f"rss {fmt_bytes(s['rss'])}")
        if s.get("swap_growth") is not None:
            parts.append(f"swap {fmt_delta(s['swap_growth'])}")
        return " | ".join(parts) or "mem n/a"

    def context(self) -> dict[str, Any]:
        """Run facts the explanation rules use beside the samples."""
        return {"backend": self.backend_name, "system_total": self._sys.system_total,
                "sample_every": self.sample_every, **self.run_facts}

    def explain(self) -> list[dict[str, Any]]:
        """Plain-sentence explanations of every sample so far (see accounting.rules)."""
        return explain_samples(self.samples, self.context())

    def _final_fold(self) -> None:
        # peaks of unsampled steps after the last sample are still in the backend's counter,
        # and the RSS high-water mark in the kernel's
        if self.sample_every <= 0:
            return
        t0 = time.perf_counter()
        self._end_peak_rss = self._sys.read(fresh=True)["peak_rss"]
        t1 = time.perf_counter()
        self.cost.sampling_seconds += t1 - t0
        if self._no_allocator:
            return
        try:
            self._fold_peaks(self.backend.memory() or MemoryReading(), self.samples[-1]["step"] if self.samples else 0,
                             "after_last_sample")
        except Exception:
            pass
        dt = time.perf_counter() - t1
        self.cost.sampling_seconds += dt
        self.cost.backend_seconds += dt

    def summary(self, step_seconds_total: float) -> dict[str, Any]:
        """The ``memory`` section of summary.json.

        Args:
            step_seconds_total: wall seconds of all training steps, to state the sampling cost
                as a fraction of step time.
        """
        self._final_fold()
        ss = self.samples
        last = ss[-1] if ss else {}
        first_opt = next((s for s in ss if s["phase"] == "optimizer"), None)
        n = len(ss)

        def peak_of(key: str) -> int | None:
            return _max(*[_int(s.get(key)) for s in ss]) if ss else None

        devices = []
        for r in last.get("devices", []):
            pk = self._dev_peak.get(r["index"], {})
            devices.append({**{k + "_bytes" if k != "index" else k: v for k, v in r.items()},
                            "peak_allocated_bytes": pk.get("allocated"), "peak_reserved_bytes": pk.get("reserved"),
                            "peak_device_used_bytes": pk.get("device_used")})
        return {
            "schema_version": 1,
            "backend": self.backend_name,
            "sample_every": self.sample_every,
            "num_samples": n,
            "samples_thinned": self.thinned,
            "peak_scope": ("peak_*: max over the whole run (the backend's peak counter is read before each "
                           "reset); step_peak_*: since the start of that step (reset_peak at each sampled step)"),
            "peaks": {
                "allocated_bytes": self._run_peak["allocated"],
                "reserved_bytes": self._run_peak["reserved"],
                "device_used_bytes": peak_of("device_used"),
                "rss_bytes": _max(peak_of("peak_rss"), peak_of("rss"), self._end_peak_rss),
                "swap_growth_bytes": peak_of("swap_growth"),
                "mlx_peak_bytes": peak_of("mlx_peak"),
            },
            "peak_at": dict(self._run_peak_at),
            "census_first_optimizer": ({"step": first_opt["step"], **_census_bytes(first_opt)} if first_opt else None),
            "census_end": ({"step": last["step"], "phase": last["phase"], **_census_bytes(last)} if last else None),
            "last": metrics_fields(last) if last else None,
            "devices": devices,
            "system_total_bytes": self._sys.system_total,
            "nvml": {"used": self._nvml.ok, "error": self._nvml.error},
            "explanations": self.explain(),
            "accounting": self.cost.report([s["sample_seconds"] for s in ss], step_seconds_total),
        }

    def table(self) -> str:
        """End-of-run table: Device rows and an Overall row, allocator and NVML side by side."""
        return render_table(self.samples, self._run_peak, self._dev_peak, sampling_seconds=self.sampling_seconds,
                            device=device_title(self.backend_name, self.samples, self.rank, self._world()))

    def _world(self) -> int:
        """The run's ranks (the backend's process group; 1 without one)."""
        return int(getattr(getattr(self.backend, "comm", None), "world_size", 1) or 1)

    def write_plot(self, path: str | Path, budget: int | None = None) -> None:
        """Write memory.png: the census as stacked areas under the measured lines, the budget
        as a line and each governor action (``run_facts["adaptations"]``) at its step."""
        peak = self._run_peak["allocated"]
        write_plot(self.samples, path, title=f"{device_title(self.backend_name, self.samples, self.rank, self._world())}: memory, "
                   f"{len(self.samples)} samples" + (f", run peak allocated {fmt_bytes(peak)}" if peak is not None else ""),
                   budget=budget, events=self.run_facts.get("adaptations"), phase_every=self.phase_every)


def _split_non_allocator(r: dict[str, Any]) -> None:
    """non_allocator = NVML used - reserved; unexplained = the part no known cause covers
    (probes.reconcile_nvml)."""
    r["non_allocator"], r["non_allocator_unexplained"] = reconcile_nvml(
        r.get("device_used"), r.get("reserved"), [r.get(k) for k in NON_ALLOCATOR_PARTS])


def _census_bytes(s: dict[str, Any]) -> dict[str, int | None]:
    return {k + "_bytes": v for k, v in (s.get("census") or {}).items()}


_METRIC_SKIP = {"index", "step", "phase", "micro", "time_s", "backend", "host", "rank", "peak_scope", "census",
                "census_step", "devices", "sample_seconds", "system_total", "system_fresh", "memory_error"}


_METRIC_NAME: dict[str, str | None] = {}  # sample key -> metrics.jsonl name (None: not written)
_CENSUS_NAME: dict[str, str] = {}


def _metric_name(k: str) -> str | None:
    if k in _METRIC_SKIP:
        name = None
    elif k in COUNT_KEYS or k in _FLOAT_KEYS or k == "pressure_level":
        name = k
    else:
        name = k + "_bytes"
    _METRIC_NAME[k] = name
    return name


def metrics_fields(s: dict[str, Any]) -> dict[str, Any]:
    """Flat metrics.jsonl fields of one sample (see Accountant.metrics_fields). Runs once per
    step, so the field names are computed once per key, not per call."""
    out: dict[str, Any] = {"memory_step": s.get("step"), "memory_phase": s.get("phase")}
    names = _METRIC_NAME
    for k, v in s.items():
        name = names[k] if k in names else _metric_name(k)
        if name is not None:
            out[name] = v
    cn = _CENSUS_NAME
    for k, v in (s.get("census") or {}).items():
        name = cn.get(k)
        if name is None:
            name = cn[k] = f"census_{k}_bytes"
        out[name] = v
    out["memory_sample_us"] = s["sample_seconds"] * 1e6 if s.get("sample_seconds") is not None else None
    return out
