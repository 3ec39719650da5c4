"""The run's records, defined once (issue 22): the memory categories, and the shapes of a census,
a sample and a plan.

Everything here is a name or a type; nothing imports the rest of the project, so the backends
(their census), the accounting (samples), the planner (plans) and the reports all read the same
definitions. Records stay plain dicts at run time (``TypedDict``): metrics.jsonl, summary.json
and plan.json are these dicts written as JSON, keys and values unchanged. Every memory figure is
an int of bytes, or None where the source cannot measure it.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

# ---- memory categories --------------------------------------------------------------------------

# What a backend's census counts: bytes of live tensors by what they are, each tensor once.
CensusKey = Literal["frozen_weights", "trainable_weights", "grads", "optimizer_state",
                    "optimizer_state_paged", "quant_buffers"]
CENSUS_KEYS: tuple[CensusKey, ...] = ("frozen_weights", "trainable_weights", "grads", "optimizer_state",
                                      "optimizer_state_paged", "quant_buffers")
# Of those, the categories the framework's allocator holds; paged optimizer state (bitsandbytes)
# lives in unified memory, outside the allocator's figures.
ALLOCATOR_HELD: tuple[CensusKey, ...] = ("frozen_weights", "trainable_weights", "grads", "optimizer_state",
                                         "quant_buffers")
# The weights a census counts (the planner's ``weights`` holds all three).
WEIGHT_KEYS: tuple[CensusKey, ...] = ("frozen_weights", "trainable_weights", "quant_buffers")
# What the Accountant adds to a sample's census: allocated minus the allocator-held categories.
ACTIVATIONS_AND_OTHER: Literal["activations_and_other"] = "activations_and_other"
SampleCensusKey = Literal[CensusKey, "activations_and_other"]

# What a plan prices, per device (plan.json's ``bytes``, in this order): ``weights`` holds every
# weight (frozen, trainable and quantization constants), ``trainable_weights`` is part of it;
# ``overhead`` is the device's context plus the allocator's rounding.
PlanKey = Literal["weights", "trainable_weights", "grads", "optimizer_state", "optimizer_state_paged",
                  "activations", "logits", "overhead"]
PLAN_KEYS: tuple[PlanKey, ...] = ("weights", "trainable_weights", "grads", "optimizer_state",
                                  "optimizer_state_paged", "activations", "logits", "overhead")
# A data-parallel rank's row of the plan (plan.json's per_rank.ranks).
RANK_KEYS: tuple[PlanKey, ...] = ("weights", "grads", "optimizer_state", "optimizer_state_paged", "activations",
                                  "logits")


# ---- census -------------------------------------------------------------------------------------

class Census(TypedDict, total=False):
    """Bytes by category: what Backend.census() returns (every CENSUS_KEYS key), and in a
    sample, the same with ``activations_and_other`` (None where allocated is unknown)."""
    frozen_weights: int | None
    trainable_weights: int | None
    grads: int | None
    optimizer_state: int | None
    optimizer_state_paged: int | None
    quant_buffers: int | None
    activations_and_other: int | None


# ---- sample -------------------------------------------------------------------------------------

class DeviceRow(TypedDict, total=False):
    """One device of a sample (``devices``): the allocator beside NVML's view of the device."""
    index: int
    allocated: int | None
    reserved: int | None
    peak_allocated: int | None
    peak_reserved: int | None
    device_total: int | None
    cuda_context: int | None
    device_used: int | None
    process_device_used: int | None
    other_processes_used: int | None
    paged_optimizer_state: int | None
    non_allocator: int | None
    non_allocator_unexplained: int | None


class DeviceReading(TypedDict, total=False):
    """One device's allocator counters as a backend reads them (``MemoryReading.devices``)."""
    index: int
    allocated: int | None
    reserved: int | None
    peak_allocated: int | None
    peak_reserved: int | None
    inactive_split: int | None
    alloc_retries: int | None
    num_ooms: int | None
    device_total: int | None
    cuda_context: int | None
    pci_bus_id: str | None
    uuid: str | None


class MemoryReading(TypedDict, total=False):
    """What ``Backend.memory()`` returns and the accountant folds into a sample: the allocator's
    figures in bytes (None where unmeasurable), the same names on every backend. ``peak_*`` are
    since the last ``reset_peak``. Backend extras keep their own names: cuda's per-device rows
    and counters, mlx's active/cache/peak and its limits."""
    allocated: int | None
    reserved: int | None
    peak_allocated: int | None
    peak_reserved: int | None
    device_total: int | None
    cuda_context: int | None
    devices: list[DeviceReading] | None
    # cuda (torch's caching allocator), summed over the devices
    inactive_split: int | None
    alloc_retries: int | None
    num_ooms: int | None
    # mlx
    mlx_active: int | None
    mlx_cache: int | None
    mlx_peak: int | None
    mlx_memory_limit: int | None
    mlx_cache_limit: int | None
    mlx_wired_limit: int | None
    mlx_recommended_working_set: int | None
    # a reading that failed (the sample says what failed; training goes on)
    memory_error: str


class Sample(TypedDict, total=False):
    """One memory sample of the Accountant's timeline (one metrics.jsonl line is drawn from it);
    finetune/accounting/accountant.py's docstring says what each figure means. A backend's
    extras pass through under their own names (those known are listed)."""
    # where
    index: int
    step: int
    phase: str
    micro: int
    time_s: float
    backend: str
    host: str
    rank: int
    # allocator
    allocated: int | None
    reserved: int | None
    step_peak_allocated: int | None
    step_peak_reserved: int | None
    peak_scope: str
    peak_allocated: int | None
    peak_reserved: int | None
    memory_error: str
    # backend extras (cuda)
    inactive_split: int | None
    alloc_retries: int | None
    num_alloc_retries: int | None
    num_ooms: int | None
    # backend extras (mlx)
    mlx_active: int | None
    mlx_cache: int | None
    mlx_peak: int | None
    mlx_memory_limit: int | None
    mlx_cache_limit: int | None
    mlx_wired_limit: int | None
    mlx_recommended_working_set: int | None
    # census
    census: Census
    census_step: int | None
    # device (NVML, CUDA)
    devices: list[DeviceRow]
    device_total: int | None
    device_used: int | None
    process_device_used: int | None
    other_processes_used: int | None
    cuda_context: int | None
    paged_optimizer_state: int | None
    non_allocator: int | None
    non_allocator_unexplained: int | None
    # process and system
    rss: int | None
    peak_rss: int | None
    swap_process: int | None
    phys_footprint: int | None
    compressed_process: int | None
    major_faults: int | None
    swap_used: int | None
    swap_total: int | None
    swap_growth: int | None
    system_total: int | None
    system_available: int | None
    psi_some_avg10: float | None
    psi_full_avg10: float | None
    pressure_level: str | None
    compressed: int | None
    swapped_in: int | None
    swapped_out: int | None
    system_fresh: bool
    # cost
    sample_seconds: float


# ---- plan ---------------------------------------------------------------------------------------

class PlanBytes(TypedDict):
    """Bytes by category on one device, or summed over devices (PLAN_KEYS)."""
    weights: int
    trainable_weights: int
    grads: int
    optimizer_state: int
    optimizer_state_paged: int
    activations: int
    logits: int
    overhead: int


class PlanTotals(TypedDict):
    """Categories, steady state and peak: of one device, or of the whole model."""
    bytes: PlanBytes
    steady_state_allocated_bytes: int
    peak_allocated_bytes: int
    peak_bytes: int
    peak_phase: str  # the step's phase at the peak (forward_backward, optimizer_step, grad_sync)


class PlanDevice(PlanTotals):
    """One device's figures (plan.json's per_device)."""
    index: int
    modules: str  # "first..last" module on this device
    overhead_detail: dict[str, int]
    buffers: dict[str, int]  # the ranks' collective buffers on this device, by name
    step1_allocated_bytes: int  # the first step's allocated peak (the optimizer's state created at its end)
    # {load, step1, steady}: {allocated_bytes, reserved_bytes, device_bytes, host_bytes}
    phases: dict[str, dict[str, int]]
    non_allocator: dict[str, int]  # what NVML counts beyond reserved, by name
    step2_reserved_leap_bytes: int  # reserved at step 2 over step 1 at the same phase's end
    alloc_conf: str | None
    device_level_planned: bool  # whether the device level is planned above the allocator (a GPU)
    evictable_bytes: int  # of the device level, what pages out under pressure (paged optimizer state)


class PlanCore(PlanTotals):
    """What pricing one setup gives (planner.price._core): the whole model's totals, per
    device, per rank."""
    params_total: int
    params_trainable: int
    max_device_peak_bytes: int
    per_device: list[PlanDevice]
    activations_detail: dict[str, int]
    quant_constants_bytes: int
    optimizer_step_workspace_bytes: int
    collective_buffers: dict[str, dict[str, Any]]  # name -> {bytes, phase it adds to}
    per_rank: dict[str, Any] | None
    # the load, step 1 and the steady state of the device whose device level peaks highest:
    # {phase: {allocated_bytes, reserved_bytes, device_bytes, host_bytes}}
    phases: dict[str, dict[str, int]]
    max_device_level_bytes: int  # the highest device level (NVML's view) of any phase and device
    max_host_bytes: int  # the process's RSS at its highest
    fits_bytes: int  # what ``fits`` compares with the budget: the device level (less paged state) where planned, else the peak
    step2_reserved_leap_bytes: int
    alloc_conf: str | None  # PYTORCH_CUDA_ALLOC_CONF the replay used (null: torch's default)


class PlanData(TypedDict, total=False):
    """What only mode=plan adds, where it could read the data (finetune.data.lengths): the samples'
    lengths, the tokens planned, and the train.seq_len plan kept as the upper bound; and what a
    backend's device limits beyond the budget (its memory model's ``device_checks``)."""
    data: dict[str, Any]
    metal: dict[str, Any]  # mlx: the peak against Metal's working set (backends/mlx/metal.py)
    # a preference objective's plan only (SFT's plans have neither): objective.name, and the
    # pairs and rows of a micro-batch, the log-prob gathers and the reference priced
    # (finetune/planner/preference.py section)
    objective: str
    preference: dict[str, Any]


class Plan(PlanCore, PlanData):
    """A run's predicted memory (plan.json), from planner.plan()."""
    schema_version: int
    backend: str
    device: str
    devices: int
    world_size: int
    strategy: str | None
    model: dict[str, Any]
    method: str
    optim: str
    precision: str
    dtypes: dict[str, Any]
    lora: dict[str, Any] | None
    batch_size: int
    grad_accum: int
    effective_batch: int
    seq_len: int
    grad_checkpointing: bool
    attn_implementation: str
    packing: dict[str, Any] | None
    # train.activation_offload: {device_saving_bytes, host_bytes, transfer_bytes_per_step, ...}; None: off
    activation_offload: dict[str, Any] | None
    device_total_bytes: int | None
    budget_bytes: int | None
    budget_source: str
    fits: bool | None
    host: dict[str, Any] | None  # a GPU plan: {ram_bytes, peak_anonymous_bytes, fits}; None where the device is the host
    recommendation: dict[str, Any] | None
    # mode=plan's "what do I need": the fewest levers that fit the budget on these devices, with
    # the host memory they take, or what would fit; None where the run fits as configured
    needs: dict[str, Any] | None
    notes: list[str]
