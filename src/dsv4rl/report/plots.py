"""One PNG per topic of a run's metrics (reward, lengths, log-prob drift, KL/entropy, time, sync, eval).

matplotlib is imported inside the drawing code, so `dsv4rl` commands other than `report` never load it.
Figures are built with `matplotlib.figure.Figure` (Agg canvas, no pyplot): no global state, no display.
A topic whose keys are all absent from the metrics is skipped with the reason, never drawn empty.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4rl.report.metrics_table import MetricsTable, rolling_mean

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LOGPROB_KEYS = (
    "train_rollout_logprob_abs_diff",
    "train_rollout_logprob_abs_diff_p95",
    "train_rollout_logprob_abs_diff_p99",
    "train_rollout_logprob_abs_diff_max",
    "logprob_abs_diff",
    "verify_probe_abs_diff",
)
KL_KEYS = ("kl", "train_rollout_kl")
TRUNCATION_KEYS = ("truncation_ratio", "truncated_fraction")  # the loop writes truncated_fraction
SYNC_KEYS = ("sync_gb_per_s", "sync_bytes", "sync_transfer_s", "sync_control_s", "sync_pipeline_s")
SYNC_TIME_KEYS = ("sync_transfer_s", "sync_control_s", "sync_pipeline_s", "time_sync_s")
EVAL_PREFIX = "eval/"
BARS_UP_TO = 100  # steps drawn as bars in the time plot


@dataclass(frozen=True)
class Topic:
    """One plot: `present` lists the keys it would draw (none present: skipped); `draw` fills the figure."""

    name: str
    missing: str  # the skip reason
    present: Callable[[MetricsTable], list[str]]
    draw: Callable[[MetricsTable, Figure], None]

    @property
    def filename(self) -> str:
        return f"{self.name}.png"


@dataclass
class PlotResult:
    written: dict[str, Path] = field(default_factory=dict)  # topic -> PNG
    skipped: dict[str, str] = field(default_factory=dict)  # topic -> why


def _any_of(*keys: str) -> Callable[[MetricsTable], list[str]]:
    return lambda table: [key for key in keys if table.has(key)]


def _phase_keys(table: MetricsTable) -> list[str]:
    return [f"time_{phase}_s" for phase in table.time_phases()]


def _eval_keys(table: MetricsTable) -> list[str]:
    return table.keys_with_prefix(EVAL_PREFIX)


def _style(ax: Axes, ylabel: str, legend: bool = True) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:  # beside the axes: never over the data
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _line(ax: Axes, table: MetricsTable, key: str, **style: object) -> None:
    steps, values = table.column(key)
    if steps:
        marker = "o" if len(steps) <= 30 else None
        ax.plot(steps, values, marker=marker, markersize=3, label=style.pop("label", key), **style)


def _draw_reward(table: MetricsTable, fig: Figure) -> None:
    ax = fig.add_subplot()
    steps, means = table.column("reward_mean")
    stds = dict(zip(*table.column("reward_std"), strict=True))
    band = [(step, mean, stds[step]) for step, mean in zip(steps, means, strict=True) if step in stds]
    if band:
        xs, ms, ss = zip(*band, strict=True)
        ax.fill_between(xs, [m - s for m, s in zip(ms, ss, strict=True)],
                        [m + s for m, s in zip(ms, ss, strict=True)],
                        alpha=0.2, label="± reward_std")  # fmt: skip
    _line(ax, table, "reward_mean")
    window = min(10, len(means) // 3)
    if window >= 2:
        ax.plot(steps, rolling_mean(means, window), linewidth=2, label=f"rolling mean ({window} steps)")
    ax.set_title("reward")
    _style(ax, "reward")


def _draw_length(table: MetricsTable, fig: Figure) -> None:
    ax = fig.add_subplot()
    _line(ax, table, "response_len_mean", color="tab:blue")
    truncation = [key for key in TRUNCATION_KEYS if table.has(key)]
    _style(ax, "tokens", legend=not truncation)
    ax.set_title("response length")
    if not truncation:
        return
    right = ax.twinx()  # a fraction in 0..1 beside a token count: its own axis, one legend for both
    _line(right, table, truncation[0], color="tab:red", linestyle="--")
    right.set_ylabel("truncated fraction")
    right.set_ylim(-0.02, 1.02)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    fig.legend(handles, [h.get_label() for h in handles], loc="outside right upper", fontsize="small")


def _draw_logprob(table: MetricsTable, fig: Figure) -> None:
    ax = fig.add_subplot()
    values: list[float] = []
    for key in LOGPROB_KEYS:
        _line(ax, table, key)
        values += table.column(key)[1]
    positive = [value for value in values if value > 0]
    if positive and max(positive) > 100 * min(positive):  # mean, tails and max span decades
        if len(positive) == len(values):
            ax.set_yscale("log")
        else:  # zeros (exact match) too: linear up to the smallest nonzero value, log above
            ax.set_yscale("symlog", linthresh=min(positive))
    ax.set_title("|log-prob difference| train vs rollout")
    _style(ax, "|Δ log p|")


def _draw_kl_entropy(table: MetricsTable, fig: Figure) -> None:
    kl = [key for key in KL_KEYS if table.has(key)]
    panels = [("KL", kl)] * bool(kl) + [("entropy", ["entropy"])] * table.has("entropy")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (label, keys) in zip(axes, panels, strict=True):
        for key in keys:
            _line(ax, table, key)
        _style(ax, label)
    axes[0].set_title("KL and entropy")
    _outer_labels(axes)


def _draw_step_time(table: MetricsTable, fig: Figure) -> None:
    """Stacked bars per step; past BARS_UP_TO steps a stacked area (thousands of bars take minutes)."""
    ax = fig.add_subplot()
    rows = table.rows
    layers = {phase: [_seconds(row, f"time_{phase}_s") for row in rows] for phase in table.time_phases()}
    accounted = [sum(values) for values in zip(*layers.values(), strict=True)]
    other = [max(_seconds(row, "time_step_s") - done, 0.0) for row, done in zip(rows, accounted, strict=True)]
    if table.has("time_step_s") and sum(other) > 0.01 * max(sum(accounted), 1e-9):
        layers["other"] = other
    colors = [f"C{index}" for index in range(len(layers))]
    if "other" in layers:
        colors[-1] = "lightgray"
    if len(rows) <= BARS_UP_TO:
        bottom = [0.0] * len(rows)
        for (name, heights), color in zip(layers.items(), colors, strict=True):
            ax.bar(table.steps, heights, 0.8, bottom=bottom, label=name, color=color, linewidth=0)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    else:
        ax.stackplot(table.steps, *layers.values(), labels=list(layers), colors=colors, linewidth=0)
    ax.set_title("time per step")
    _style(ax, "seconds")


def _seconds(row: dict[str, object], key: str) -> float:
    value = row.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _draw_sync(table: MetricsTable, fig: Figure) -> None:
    rate_key = next((key for key in ("sync_gb_per_s", "sync_bytes") if table.has(key)), None)
    times = [key for key in SYNC_TIME_KEYS if table.has(key)]
    axes = fig.subplots(1 + bool(rate_key and times), 1, sharex=True, squeeze=False)[:, 0]
    title = "weight sync"
    sizes = table.column("sync_bytes")[1]
    if len(set(sizes)) == 1:  # the same weights every step: say it once, in the title
        title += f" ({fmt_bytes(sizes[0])} per sync)"
    if rate_key == "sync_gb_per_s":
        _line(axes[0], table, "sync_gb_per_s")
        _style(axes[0], "GB/s")
    elif rate_key == "sync_bytes":
        steps, sizes = table.column("sync_bytes")
        axes[0].plot(steps, [size / 1e6 for size in sizes], marker="o", markersize=3, label="sync_bytes (MB)")
        _style(axes[0], "MB")
    if times:
        for key in times:
            _line(axes[-1], table, key)
        _style(axes[-1], "seconds")
    axes[0].set_title(title)
    _outer_labels(axes)


def fmt_bytes(size: float) -> str:
    """Decimal units, as sync_gb_per_s counts them."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.0f} B"


def _outer_labels(axes: Sequence[Axes]) -> None:
    """Stacked panels share the step axis: its label and ticks only on the bottom one."""
    for ax in axes:
        ax.label_outer()


def _draw_eval(table: MetricsTable, fig: Figure) -> None:
    keys = _eval_keys(table)
    lengths = [key for key in keys if key.startswith(f"{EVAL_PREFIX}response_len")]
    scores = [key for key in keys if key not in lengths]
    panels = [(scores, "score")] * bool(scores) + [(lengths, "tokens")] * bool(lengths)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (panel_keys, label) in zip(axes, panels, strict=True):
        for key in panel_keys:  # points only where a step evaluated, joined for reading the trend
            steps, values = table.column(key)
            ax.plot(steps, values, marker="o", markersize=4, label=key.removeprefix(EVAL_PREFIX))
        _style(ax, label)
    axes[0].set_title("evaluation")
    _outer_labels(axes)


def _none_of(keys: tuple[str, ...]) -> str:
    return f"none of {', '.join(keys)} in the metrics"


TOPICS = (
    Topic("reward", "no reward_mean in the metrics", _any_of("reward_mean"), _draw_reward),
    Topic(
        "response_length", "no response_len_mean in the metrics", _any_of("response_len_mean"), _draw_length
    ),
    Topic("logprob_diff", _none_of(LOGPROB_KEYS), _any_of(*LOGPROB_KEYS), _draw_logprob),
    Topic("kl_entropy", _none_of((*KL_KEYS, "entropy")), _any_of(*KL_KEYS, "entropy"), _draw_kl_entropy),
    Topic("step_time", "no time_<phase>_s keys in the metrics", _phase_keys, _draw_step_time),
    Topic("sync", _none_of(SYNC_KEYS), _any_of(*SYNC_KEYS), _draw_sync),
    Topic("eval", "no eval/... keys in the metrics (no evaluation during training)", _eval_keys, _draw_eval),
)


def render_plots(table: MetricsTable, out_dir: Path, topics: tuple[Topic, ...] = TOPICS) -> PlotResult:
    """Write `<topic>.png` into `out_dir` for each topic with data; remove a skipped topic's old PNG
    (from an earlier report into the same folder) so the folder never shows a stale plot."""
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    result = PlotResult()
    for topic in topics:
        path = out_dir / topic.filename
        if not topic.present(table):
            result.skipped[topic.name] = topic.missing
            path.unlink(missing_ok=True)
            continue
        fig = Figure(figsize=(8, 4.5), dpi=110, layout="constrained")
        topic.draw(table, fig)
        fig.savefig(path, format="png")
        result.written[topic.name] = path
    return result
