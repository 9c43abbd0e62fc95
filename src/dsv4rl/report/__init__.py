"""`dsv4rl report RUN_DIR`: PNG plots and a Markdown summary of a run, from its metrics.jsonl alone."""

from dsv4rl.report.build import Report, build_report, print_report
from dsv4rl.report.metrics_table import ReportError

__all__ = ["Report", "ReportError", "build_report", "print_report"]
