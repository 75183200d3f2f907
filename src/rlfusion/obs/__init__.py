"""Observability: metrics (JSONL + TensorBoard), plots, run summaries, timelines.

Importing this package loads neither torch nor matplotlib: `MetricsWriter` imports
TensorBoard only when asked to, and the plot functions import matplotlib when called.
"""

from rlfusion.obs.files import atomic_write_text
from rlfusion.obs.metrics import MetricsWriter, read_metrics, truncate_metrics
from rlfusion.obs.plots import DEFAULT_PANELS, plot_metrics, plot_panels_grid
from rlfusion.obs.summary import format_table, write_summary

__all__ = [
    "DEFAULT_PANELS", "MetricsWriter", "atomic_write_text", "format_table", "plot_metrics",
    "plot_panels_grid", "read_metrics", "truncate_metrics", "write_summary",
]
