"""`distillery compare`: runs side by side from MLflow: the config fields that differ, best KL, top-1, tokens/s and
the share of the baseline's KL gap the adapter closed.

Every run logs the same metric keys on the same step axes (tasks/tracking.py): train/<name> per optimizer step,
epoch/<name> and eval/<name> per epoch, baseline/<name>, best/<name> and merged/<name> at step 0, and the whole
config as params; so this table and the MLflow UI's compare view (whose URL is printed for a tracking server)
line runs up by the same names.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

# Metric keys the table reads (logged by tasks/tracking.py).
BEST_KL, BEST_TOP1, BASELINE_KL, TOKENS_PER_S = "best/kl", "best/top1", "baseline/kl", "epoch/tokens_per_s"
# Params that name where a run was tracked, not what it computed: never shown as a difference.
IGNORED_PARAMS = frozenset({"run.mlflow_uri", "run.run_name"})


class CompareError(ValueError):
    """Nothing to compare (unknown experiment or run); one line for the user."""


@dataclass(frozen=True)
class RunRow:
    """One run's row of the comparison."""

    run_id: str
    name: str
    status: str
    differences: dict[str, str] = field(default_factory=dict)
    best_kl: float | None = None
    top1: float | None = None
    tokens_per_s: float | None = None
    baseline_kl: float | None = None

    @property
    def gap_closed(self) -> float | None:
        """(baseline KL - best KL) / baseline KL: the share of the student's KL gap the adapter removed."""
        if self.best_kl is None or not self.baseline_kl:
            return None
        return (self.baseline_kl - self.best_kl) / self.baseline_kl


def tracking_uri(config: Path | None, workdir: Path | None, uri: str | None) -> tuple[str, str | None]:
    """(tracking URI, the config's experiment or None): --tracking-uri, else the config's run section, else the
    sqlite store of --workdir, else $MLFLOW_TRACKING_URI or the sqlite store of runs/default."""
    if uri:
        return uri, None
    if config is not None:
        from schemas.config import load_config

        cfg = load_config(config)
        return cfg.run.tracking_uri(), cfg.run.experiment
    if workdir is not None:  # the workdir's own store (as RunSection.tracking_uri names it), whatever the env says
        return f"sqlite:///{(workdir / 'mlflow.db').resolve()}", None
    from schemas.config import RunSection

    return RunSection().tracking_uri(), None


def find_runs(client: Any, experiment: str, selectors: Sequence[str]) -> list[Any]:
    """The experiment's runs named by id or run name (in the order given), or all of them, oldest first."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = ", ".join(e.name for e in client.search_experiments()) or "none"
        raise CompareError(f"no MLflow experiment {experiment!r} in {client.tracking_uri} (experiments: {names})")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"], max_results=1000)
    if not selectors:
        return list(runs)
    chosen = []
    for sel in selectors:
        match = [r for r in runs if r.info.run_id == sel or r.info.run_id.startswith(sel) or r.info.run_name == sel]
        if not match:
            raise CompareError(f"no run {sel!r} in experiment {experiment!r} (give a run id, id prefix or run name)")
        chosen.extend(m for m in match if m not in chosen)
    return chosen


def differences(params: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """Per run, the config params whose value is not the same in every run (absent shown as '–')."""
    keys = sorted({k for p in params for k in p} - IGNORED_PARAMS)
    varying = [k for k in keys if len({p.get(k) for p in params}) > 1]
    return [{k: p.get(k, "–") for k in varying} for p in params]


def rows(runs: Sequence[Any]) -> list[RunRow]:
    """A RunRow per MLflow run, config differences taken across `runs`."""
    diffs = differences([dict(r.data.params) for r in runs])
    out = []
    for run, diff in zip(runs, diffs, strict=True):
        m = run.data.metrics
        out.append(
            RunRow(
                run_id=run.info.run_id,
                name=run.info.run_name or "",
                status=run.info.status,
                differences=diff,
                best_kl=m.get(BEST_KL),
                top1=m.get(BEST_TOP1),
                tokens_per_s=m.get(TOKENS_PER_S),
                baseline_kl=m.get(BASELINE_KL),
            )
        )
    return out


def compare_view_url(uri: str, experiment_id: str, run_ids: Sequence[str]) -> str | None:
    """The MLflow UI's compare view of these runs (for a tracking server; None for a local store)."""
    if not uri.startswith(("http://", "https://")):
        return None
    query = urllib.parse.urlencode({"runs": json.dumps(list(run_ids)), "experiments": json.dumps([experiment_id])})
    return f"{uri.rstrip('/')}/#/compare-runs?{query}"


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def table(experiment: str, table_rows: Sequence[RunRow]) -> Table:
    """The comparison as a rich table."""
    out = Table(title=f"MLflow experiment {experiment}: {len(table_rows)} runs")
    out.add_column("run")
    out.add_column("config (differences)")
    for col in ("best KL", "top-1", "tokens/s", "gap closed"):
        out.add_column(col, justify="right")
    for r in table_rows:
        diff = "\n".join(f"{k}={v}" for k, v in r.differences.items()) or "–"
        status = "" if r.status == "FINISHED" else f" [{r.status.lower()}]"
        out.add_row(
            f"{r.name}{status}\n{r.run_id[:12]}",
            diff,
            _num(r.best_kl, ".4f"),
            "–" if r.top1 is None else f"{100 * r.top1:.1f}%",
            _num(r.tokens_per_s, ".0f"),
            "–" if r.gap_closed is None else f"{100 * r.gap_closed:.1f}%",
        )
    return out


def _check_store(uri: str) -> None:
    """A sqlite store must exist already: opening a missing one would create it (and its folders)."""
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise CompareError(
            f"no MLflow store {uri.removeprefix('sqlite:///')}: no run was tracked there (give the --workdir or "
            "--config of a run, or --tracking-uri)"
        )


def compare_runs(
    console: Console,
    selectors: Sequence[str],
    *,
    experiment: str | None = None,
    config: Path | None = None,
    workdir: Path | None = None,
    uri: str | None = None,
) -> list[RunRow]:
    """Print the comparison of the selected runs (all runs of the experiment by default); return its rows."""
    from mlflow import MlflowClient

    resolved, config_experiment = tracking_uri(config, workdir, uri)
    _check_store(resolved)
    name = experiment or config_experiment or "distillery"
    client = MlflowClient(tracking_uri=resolved)
    runs = find_runs(client, name, selectors)
    if not runs:
        raise CompareError(f"experiment {name!r} in {resolved} has no runs yet")
    result = rows(runs)
    console.print(table(name, result))
    url = compare_view_url(resolved, runs[0].info.experiment_id, [r.info.run_id for r in runs])
    if url:
        console.print(f"MLflow compare view: {url}")
    return result
