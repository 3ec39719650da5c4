"""Memory accounting: samples, census, explanations, tables and plots.

Imports neither torch nor mlx: the backend supplies allocator figures (Backend.memory) and the
census (Backend.census); this package reads the process, the system and NVML itself.
"""

from finetune.accounting.accountant import ALLOCATOR_HELD, CENSUS_KEYS, Accountant, metrics_fields
from finetune.accounting.gather import gather, gather_timeline
from finetune.accounting.render import (
    render_gather_table,
    render_summary_table,
    render_table,
    write_plot,
)
from finetune.accounting.rules import explain
from finetune.units import fmt_bytes, fmt_delta

__all__ = [
    "ALLOCATOR_HELD", "CENSUS_KEYS", "Accountant", "explain", "fmt_bytes", "fmt_delta", "gather", "gather_timeline",
    "metrics_fields", "render_gather_table", "render_summary_table", "render_table", "write_plot",
]
