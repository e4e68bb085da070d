"""MLflow and Prefect records of a flow run: one MLflow run per flow run, logged through MlflowClient with an
explicit run id (no global MLflow state), and a Prefect markdown artifact with the before/after table.

MLflow run: params = the whole config flattened; tags = Prefect flow-run id/name, git commit, model sha256s;
metrics = every optimizer step (live from the train task, backfilled from steps.jsonl for cached or resumed
epochs), per-epoch train/eval metrics, baseline and best; artifacts = config.yaml, report.md, loss/KL PNGs,
the selected adapter (PEFT dir + GGUF LoRA); a registered model version for that adapter
(create_registered_model + create_model_version: register_model fails for plain artifacts). With the default
sqlite URI the experiment's artifacts go to <workdir>/mlartifacts, where infra/mlflow-server.sh serves them.
"""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from data.topk import bytes_per_position
from schemas.config import RunConfig, dump_config
from schemas.manifests import (
    CheckpointManifest,
    EvalManifest,
    ExportManifest,
    PrefixManifest,
    StudentManifest,
    TeacherManifest,
    TokenizeManifest,
)
from stages.evaluate import gain_kept, gain_note
from stages.layout import file_name, inside, workdir
from stages.train import read_steps
from tasks.cached import cached_run, remember
from tasks.caching import as_config, stage_states
from tasks.mlflow_store import seed_store
from tasks.stage_locks import STAGE_LOCKS

ADAPTER_ARTIFACT = "adapter"
STEP_METRICS = ("loss", "grad_norm", "lr", "tokens_per_s", "skipped")
_logged_lock = threading.Lock()
_LOGGED: dict[str, set[int]] = {}  # MLflow run id -> optimizer steps already logged in this process


class TrackingUriError(ValueError):
    """run.mlflow_uri (or $MLFLOW_TRACKING_URI) names no store MLflow opens: one line naming it."""


def client_for(cfg: RunConfig) -> Any:
    """An MlflowClient on cfg.run.tracking_uri() (tracking and model registry); TrackingUriError naming the field
    when MLflow refuses the URI (a plain path or file:// is its retired file store)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = cfg.run.tracking_uri()
    seed_store(uri)
    try:
        return MlflowClient(tracking_uri=uri, registry_uri=uri)
    except MlflowException as exc:
        field = "run.mlflow_uri" if cfg.run.mlflow_uri else "$MLFLOW_TRACKING_URI"
        why = str(exc.message).split(". ")[0]
        raise TrackingUriError(
            f"{field}: {uri!r}: {why}; give a database (sqlite:///<file>) or a server (http://host:port)"
        ) from None


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """{"lora.r": "16", ...} from a nested JSON dict; lists as their JSON-ish str."""
    if isinstance(value, Mapping):
        out: dict[str, str] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: str(value)}


def git_commit() -> str | None:
    """HEAD of the git checkout distillery's code is in, if any (plus '-dirty' with local changes); not the
    current directory's, which may be any other repository."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=here, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "-uno"], capture_output=True, text=True, timeout=5, cwd=here
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


# ---------------------------------------------------------------------------------------------- steps


def log_metrics(client: Any, run_id: str, values: Mapping[str, float], step: int = 0) -> None:
    """Log the finite `values` to MLflow run `run_id` as one batch at `step`."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step) for k, v in values.items() if math.isfinite(float(v))]
    if batch:
        client.log_batch(run_id, metrics=batch)


class StepLogger:
    """Per-step metrics into an MLflow run, batched (one write every `every` steps or `seconds`)."""

    def __init__(self, cfg: RunConfig | None, run_id: str | None, every: int = 20, seconds: float = 5.0) -> None:
        self.client = client_for(cfg) if cfg is not None and run_id else None
        self.run_id, self.every, self.seconds = run_id, every, seconds
        self._rows: list[dict[str, Any]] = []
        self._last = time.monotonic()

    def log(self, row: Mapping[str, Any]) -> None:
        if self.client is None:
            return
        self._rows.append(dict(row))
        if len(self._rows) >= self.every or time.monotonic() - self._last > self.seconds:
            self.flush()

    def flush(self) -> None:
        if self.client is None or not self._rows:
            return
        log_steps(self.client, str(self.run_id), self._rows)
        self._rows, self._last = [], time.monotonic()


def step_logger(cfg: RunConfig, run_id: str | None) -> StepLogger:
    """A StepLogger for the train task (a no-op without a run id)."""
    return StepLogger(cfg, run_id)


def log_steps(client: Any, run_id: str, rows: list[Mapping[str, Any]]) -> None:
    """Log step rows as metrics train/<name> at their global step (finite values only)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [
        Metric(f"train/{name}", float(row[name]), now, int(row["step"]))
        for row in rows
        for name in STEP_METRICS
        if name in row and math.isfinite(float(row[name]))
    ]
    for i in range(0, len(metrics), 900):
        client.log_batch(run_id, metrics=metrics[i : i + 900])
    with _logged_lock:
        _LOGGED.setdefault(run_id, set()).update(int(row["step"]) for row in rows)


# ---------------------------------------------------------------------------------------------- the run


class FlowRunRecord:
    """What every flow run's MLflow record holds (its ids, where to see it, when it started) and the stage results
    both flows share; the flow assigns stage results to its attributes."""

    def __init__(self, cfg: RunConfig, client: Any, run_id: str, experiment_id: str, flow_run: Any) -> None:
        self.cfg, self.client, self.id, self.experiment_id = cfg, client, run_id, experiment_id
        self.flow_run_id, self.flow_run_name = str(flow_run.id), str(flow_run.name)
        self.prefect_url = prefect_ui_url(flow_run)
        self.started = time.perf_counter()
        self.student: StudentManifest | None = None
        self.checkpoints: list[CheckpointManifest] = []
        self.best: int | None = None
        self.exported: ExportManifest | None = None

    def _metrics(self, values: Mapping[str, float], step: int = 0) -> None:
        log_metrics(self.client, self.id, values, step)

    def _log_adapter(self, files: Mapping[str, str]) -> None:
        """The exported PEFT dir and GGUF LoRA (of those in `files`) as the run's adapter artifacts."""
        root = workdir(self.cfg)
        if "peft_dir" in files:
            self.client.log_artifacts(self.id, str(root / files["peft_dir"]), f"{ADAPTER_ARTIFACT}/peft")
        if "gguf_lora" in files:
            self.client.log_artifact(self.id, str(root / files["gguf_lora"]), ADAPTER_ARTIFACT)

    def _register_adapter(self, description: str, tags: Mapping[str, str]) -> dict[str, Any]:
        """A model version of the selected adapter under '<experiment>-adapter', tagged with `tags` and its
        sha256; an adapter registered before (a cached rerun) is not registered again."""
        from mlflow.exceptions import MlflowException

        assert self.best is not None
        name = registered_model_name(self.cfg.run.experiment)
        try:
            self.client.create_registered_model(name, description=description)
        except MlflowException as exc:
            if "RESOURCE_ALREADY_EXISTS" not in str(getattr(exc, "error_code", "")) + str(exc):
                raise
        adapter_sha = self.checkpoints[self.best].adapter.sha256
        # one version per adapter, also when two flow runs of one config finish together (two workers)
        lock, holder = f"mlflow-model-{file_name(name)}", f"{os.getpid()}-{threading.get_ident()}"
        STAGE_LOCKS.acquire_lock(lock, holder)
        try:
            for existing in self.client.search_model_versions(f"name='{name}'"):
                if existing.tags.get("adapter.sha256") == adapter_sha:  # a cached rerun: already registered
                    return {"name": name, "version": str(existing.version), "source": existing.source, "new": False}
            source = f"{self.client.get_run(self.id).info.artifact_uri}/{ADAPTER_ARTIFACT}"
            version = self.client.create_model_version(
                name, source=source, run_id=self.id, tags={**tags, "adapter.sha256": adapter_sha}
            )
        finally:
            STAGE_LOCKS.release_lock(lock, holder)
        return {"name": name, "version": str(version.version), "source": source, "new": True}


class RunRecord(FlowRunRecord):
    """What a distillation flow run produced and its MLflow run."""

    def __init__(
        self,
        cfg: RunConfig,
        client: Any,
        run_id: str,
        experiment_id: str,
        flow_run: Any,
        until: str = "export",
        reused: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(cfg, client, run_id, experiment_id, flow_run)
        self.until = until
        self.reused = reused  # the summary of the run whose results this one reuses entirely: log nothing
        self.tokens: TokenizeManifest | None = None
        self.teacher: TeacherManifest | None = None
        self.prefix: PrefixManifest | None = None
        self.baseline: EvalManifest | None = None
        self.evals: list[EvalManifest] = []
        self.merged: EvalManifest | None = None

    def _log_training(self) -> None:
        if not self.checkpoints:
            return
        with _logged_lock:
            logged = set(_LOGGED.get(self.id, set()))
        missing = [row for row in read_steps(self.cfg, self.checkpoints[-1]) if int(row["step"]) not in logged]
        if missing:
            log_steps(self.client, self.id, missing)
        for ckpt in self.checkpoints:
            self._metrics({f"epoch/{k}": v for k, v in ckpt.metrics.items()}, step=ckpt.epoch)

    def _log_evals(self) -> None:
        if self.baseline is not None:
            self._metrics({f"baseline/{k}": v for k, v in _eval_values(self.baseline).items()})
        for ev in self.evals:
            self._metrics({f"eval/{k}": v for k, v in _eval_values(ev).items()}, step=ev.epoch or 0)
        if self.best is not None:
            self._metrics({f"best/{k}": v for k, v in _eval_values(self.evals[self.best]).items()})
            self._metrics({"best/epoch": self.best})
        if self.merged is not None:
            self._metrics({f"merged/{k}": v for k, v in _eval_values(self.merged).items()})
            kept = self._gain_kept()
            if kept is not None:
                self._metrics({"merged/gain_kept": kept})

    def _gain_kept(self) -> float | None:
        """The fraction of the best adapter's held-out KL gain the merged GGUF keeps (None without the three)."""
        if self.merged is None or self.baseline is None or self.best is None:
            return None
        best = self.evals[self.best]
        return gain_kept(self.baseline.metric("kl"), best.metric("kl"), self.merged.metric("kl"))

    # ---- end of run ----
    def summary(self) -> dict[str, Any]:
        """JSON summary: stages ran/cached, before/after metrics, files, where the records are."""
        states = stage_states(self.flow_run_id)
        best = None if self.best is None else self.evals[self.best]
        root = workdir(self.cfg)
        return {
            **summary_header(self, states),
            "checkpoints": [manifest_json(c) for c in self.checkpoints],
            "baseline": manifest_json(self.baseline),
            "evals": [manifest_json(e) for e in self.evals],
            "best_epoch": None if best is None else best.epoch,
            "best": manifest_json(best),
            "merged": manifest_json(self.merged),
            "merged_gain_kept": self._gain_kept(),
            "lora_kind": self.cfg.lora.kind,
            "export": manifest_json(self.exported),
            "files": {} if self.exported is None else self.exported.files(),
            "teacher_bytes_per_position": None
            if self.teacher is None
            else bytes_per_position(self.teacher, self.teacher.path_in(root)),
            "workdir": str(root),
            "seconds": time.perf_counter() - self.started,
        }

    def finish(self) -> dict[str, Any]:
        """Log what the run produced, write report.md and plots, register the adapter, end the MLflow run,
        remember the run (tasks.cached). A run that reused every result logs nothing: its summary names the
        run that made them."""
        if self.reused is not None:
            now = self.summary()  # this flow run: its stages (all cached), its ids; the MLflow run reused
            summary = {**self.reused, **{k: now[k] for k in ("flow_run_id", "flow_run_name", "prefect_url", "stages")}}
            summary["reused"] = True
            summary["seconds"] = time.perf_counter() - self.started
            _prefect_markdown(render_report(self.cfg, summary))
            return summary
        self._tag_models()
        self._log_training()
        self._log_evals()
        summary = self.summary()
        report = render_report(self.cfg, summary)
        report_path, plots = report_paths(workdir(self.cfg), self.flow_run_name)
        report_path.write_text(report, encoding="utf-8")
        (workdir(self.cfg) / "report.md").write_text(report, encoding="utf-8")
        summary["report"] = str(report_path)
        self.client.log_artifact(self.id, str(report_path), "report")
        for plot in write_plots(self.cfg, self, plots):
            self.client.log_artifact(self.id, str(plot), "plots")
        if self.exported is not None and self.best is not None:
            self._log_adapter(self.exported.files())
            best = self.evals[self.best]
            tags = {"epoch": str(best.epoch), "kl": f"{best.kl:.6g}", "top1": f"{best.top1:.6g}"}
            summary["registered_model"] = self._register_adapter("LoRA adapters distilled by distillery", tags)
        _prefect_markdown(report)
        self.client.set_terminated(self.id, "FINISHED")
        remember(self.cfg, self.until, summary)
        return summary

    def _tag_models(self) -> None:
        """Tag the run with the sha256 of the models it used."""
        tags = {}
        if self.student is not None:
            tags["student.source_sha256"] = self.student.source_sha256
            tags["student.sha256"] = self.student.file.sha256
        if self.teacher is not None:
            tags["teacher.sha256"] = self.teacher.teacher_sha256
        for key, value in tags.items():
            self.client.set_tag(self.id, key, value)


def registered_model_name(experiment: str) -> str:
    """The registered model of an experiment's adapters: `<experiment>-adapter`, with the '/' and ':' MLflow refuses
    in a model name (an experiment may hold them, e.g. a Databricks path) as '_' and no leading dot."""
    return (re.sub(r"[/:]", "_", experiment).lstrip(".") or "distillery") + "-adapter"


def report_paths(root: Path, flow_run_name: str) -> tuple[Path, Path]:
    """(<root>/reports/<name>.md, <root>/reports/<name>-plots) of a flow run, never outside root (the folder
    created)."""
    name = file_name(flow_run_name)
    report, plots = inside(root, "reports", f"{name}.md"), inside(root, "reports", f"{name}-plots")
    report.parent.mkdir(parents=True, exist_ok=True)
    return report, plots


def _eval_values(ev: EvalManifest) -> dict[str, float]:
    values = {"kl": ev.kl, "top1": ev.top1, "ce": ev.ce, "ppl": ev.ppl}
    more = {"ece": ev.ece, "ece_teacher": ev.ece_teacher}
    return {**values, **{k: v for k, v in more.items() if v is not None}}


def summary_header(record: Any, states: list[tuple[str, str]]) -> dict[str, Any]:
    """The run summary's opening keys for a flow run record (its Prefect and MLflow runs, the stages that ran
    and those reused), shared by the distillation and preference summaries."""
    return {
        "flow_run_id": record.flow_run_id,
        "flow_run_name": record.flow_run_name,
        "prefect_url": record.prefect_url,
        "mlflow": {
            "tracking_uri": record.cfg.run.tracking_uri(),
            "experiment_id": record.experiment_id,
            "run_id": record.id,
            "url": mlflow_ui_url(record.cfg, record.experiment_id, record.id),
        },
        "stages": {
            "ran": [name for name, state in states if state == "Completed"],
            "cached": [name for name, state in states if state == "Cached"],
        },
    }


def manifest_json(manifest: Any) -> Any:
    """A manifest as the JSON-able dict of the run summary (None stays None)."""
    return None if manifest is None else manifest.model_dump(mode="json")


def prefect_ui_url(flow_run: Any) -> str | None:
    """The flow run's page in the Prefect UI (as Prefect's "View at" line gives it); None without a UI to
    open: no server URL (not 'None/flow-runs/...') or the CLI's temporary server (no UI, gone after the run:
    DISTILLERY_PREFECT_SERVER=temporary)."""
    from prefect.settings import PREFECT_UI_URL

    base = PREFECT_UI_URL.value()
    if not base or os.environ.get("DISTILLERY_PREFECT_SERVER") == "temporary":
        return None
    return f"{str(base).rstrip('/')}/runs/flow-run/{flow_run.id}"


def mlflow_ui_url(cfg: RunConfig, experiment_id: str, run_id: str) -> str:
    """Where the run shows in the MLflow UI (infra/mlflow-server.sh for the default sqlite store)."""
    uri = cfg.run.tracking_uri()
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def _prefect_markdown(report: str) -> None:
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=report, key="distill-report", description="before/after distillation")


@contextmanager
def mlflow_run(cfg: RunConfig, until: str = "export") -> Iterator[RunRecord]:
    """Start the flow run's MLflow run (params, tags, config.yaml); mark it FAILED if the block raises. When
    every stage up to `until` is a verified cache hit of a remembered run, reuse that run's MLflow run instead
    (no new run, nothing logged)."""
    from prefect.runtime import flow_run

    started = time.perf_counter()
    cfg = as_config(cfg)
    reused = cached_run(cfg, until)
    if reused is not None:
        mlflow = reused["mlflow"]
        record = RunRecord(cfg, None, mlflow["run_id"], mlflow["experiment_id"], flow_run, until, reused)
        record.started = started
        yield record
        return
    client = client_for(cfg)
    experiment_id, run_id = create_flow_run(cfg, client, flow_run)
    record = RunRecord(cfg, client, run_id, experiment_id, flow_run, until)
    record.started = started
    with failed_on_error(client, run_id):
        log_config(cfg, client, run_id)
        yield record


@contextmanager
def failed_on_error(client: Any, run_id: str) -> Iterator[None]:
    """Mark the MLflow run FAILED when the block raises (the exception goes on)."""
    try:
        yield
    except BaseException:
        try:
            client.set_terminated(run_id, "FAILED")
        except Exception as exc:  # noqa: BLE001 -- e.g. the disk that failed the run is full: keep its error
            logging.getLogger(__name__).warning("MLflow run %s not marked FAILED: %s", run_id, exc)
        raise


def _experiment(cfg: RunConfig, client: Any) -> str:
    """The id of cfg.run.experiment, created when missing: with the default sqlite store its artifacts go under
    the workdir (not ./mlruns), with a tracking server where the server keeps them. Two runs creating it at once
    (two workers) both get the one that exists."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(cfg.run.experiment)
    if exp is not None:
        return exp.experiment_id
    local = cfg.run.tracking_uri().startswith("sqlite:")
    try:
        return client.create_experiment(cfg.run.experiment, (workdir(cfg) / "mlartifacts").as_uri() if local else None)
    except MlflowException as exc:
        exp = client.get_experiment_by_name(cfg.run.experiment)
        if exp is None or "RESOURCE_ALREADY_EXISTS" not in str(getattr(exc, "error_code", "")) + str(exc):
            raise
        return exp.experiment_id


def create_flow_run(cfg: RunConfig, client: Any, flow_run: Any, **tags: str) -> tuple[str, str]:
    """(experiment id, run id) of the MLflow run for the Prefect `flow_run` in cfg.run.experiment (created when
    missing; with the default sqlite store its artifacts go under the workdir, not ./mlruns), tagged with the
    Prefect ids, the git commit and `tags`: a new run, or the flow run's own from an earlier attempt."""
    experiment_id = _experiment(cfg, client)
    for run in client.search_runs(
        [experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run.id}'", max_results=1
    ):  # a flow run scheduled again after a crash (infra/automations.py) keeps its MLflow run
        client.update_run(run.info.run_id, status="RUNNING")
        return experiment_id, run.info.run_id
    tags = {"prefect.flow_run_id": str(flow_run.id), "prefect.flow_run_name": str(flow_run.name), **tags}
    if commit := git_commit():
        tags["git.commit"] = commit
    run = client.create_run(experiment_id, run_name=cfg.run.run_name or str(flow_run.name), tags=tags)
    return experiment_id, run.info.run_id


def log_config(cfg: RunConfig, client: Any, run_id: str) -> None:
    """The flattened config as the run's params (MLflow takes 100 a batch, values up to 6000 characters) and
    config.resolved.yaml (written into the workdir) as its artifact."""
    from mlflow.entities import Param

    params = [Param(k, v[:6000]) for k, v in flatten(cfg.model_dump(mode="json")).items()]
    for i in range(0, len(params), 90):
        client.log_batch(run_id, params=params[i : i + 90])
    config_path = workdir(cfg) / "config.resolved.yaml"
    config_path.write_text(dump_config(cfg), encoding="utf-8")
    client.log_artifact(run_id, str(config_path))


# ---------------------------------------------------------------------------------------------- report


def _row(label: str, ev: Mapping[str, Any] | None) -> str:
    if ev is None:
        return f"| {label} | – | – | – | – | – |"
    ece = "–" if ev.get("ece") is None else f"{ev['ece']:.4f}"
    return f"| {label} | {ev['kl']:.4f} | {100 * ev['top1']:.1f}% | {ev['ce']:.4f} | {ev['ppl']:.2f} | {ece} |"


def render_report(cfg: RunConfig, s: Mapping[str, Any]) -> str:
    """report.md: the before/after table (KL, top-1, CE), stages ran/cached, files, MLflow run link."""
    lines = [f"# distillery run `{s['flow_run_name']}`", ""]
    if s.get("baseline") is not None or s.get("evals"):
        lines += [
            "| student | KL(teacher‖student) | top-1 agreement | CE | ppl | ECE (top-1) |",
            "|---|---|---|---|---|---|",
        ]
        lines.append(_row("before: no adapter", s.get("baseline")))
        for ev in s.get("evals") or []:
            mark = " **(best)**" if s.get("best") is not None and ev["epoch"] == s["best_epoch"] else ""
            lines.append(_row(f"epoch {ev['epoch']}{mark}", ev))
        if s.get("merged") is not None:
            lines.append(_row("merged GGUF", s["merged"]))
        base, best = s.get("baseline"), s.get("best")
        if base is not None and best is not None:
            drop = base["kl"] - best["kl"]
            pct = 100 * drop / base["kl"] if base["kl"] else 0.0
            lines += [
                "",
                f"Held-out KL {base['kl']:.4f} → {best['kl']:.4f} ({'fell' if drop > 0 else 'rose'} by "
                f"{abs(drop):.4f}, {abs(pct):.1f}%); top-1 agreement {100 * base['top1']:.1f}% → "
                f"{100 * best['top1']:.1f}% (best by {cfg.eval.best_metric}).",
            ]
            note = gain_note(s.get("merged_gain_kept"), cfg.lora.kind)
            if note:
                lines += ["", note]
        lines.append("")
    stages = s.get("stages", {})
    lines += [
        f"Stages run: {', '.join(stages.get('ran', [])) or 'none'}  ",
        f"Stages cached: {', '.join(stages.get('cached', [])) or 'none'}",
        "",
    ]
    files = s.get("files") or {}
    if files:
        lines.append("Files (under the workdir):")
        for key, label in (("peft_dir", "PEFT adapter"), ("gguf_lora", "GGUF LoRA (llama.cpp --lora)")):
            if key in files:
                lines.append(f"- {label}: `{files[key]}`")
        if "merged" in files:
            merge = s["export"]["merge_report"]
            how = "folded" if merge.get("fold") else "re-quantized"
            size = (
                f", {merge['file_bytes'] / merge['base_file_bytes']:.3f}x the student's size"
                if "file_bytes" in merge
                else ""
            )
            lines.append(f"- merged GGUF: `{files['merged']}` ({how}, merge error rms {merge['error_rms']:.3g}{size})")
        lines.append("")
    ml = s["mlflow"]
    lines += [
        f"MLflow: run `{ml['run_id']}` in `{ml['tracking_uri']}` — {ml['url']}",
        f"Prefect: flow run `{s['flow_run_id']}`" + (f" — {s['prefect_url']}" if s.get("prefect_url") else ""),
        "",
    ]
    return "\n".join(lines)


def write_plots(cfg: RunConfig, record: RunRecord, out: Path) -> list[Path]:
    """loss.png (train loss per step) and kl.png (held-out KL per epoch vs the baseline); [] without
    matplotlib or data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    steps = read_steps(cfg, record.checkpoints[-1]) if record.checkpoints else []
    if steps:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=1)
        ax.set(xlabel="optimizer step", ylabel="KD loss", title="training loss")
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=100)
        plt.close(fig)
        paths.append(out / "loss.png")
    if record.evals:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([e.epoch for e in record.evals], [e.kl for e in record.evals], "o-", label="with adapter")
        if record.baseline is not None:
            ax.axhline(record.baseline.kl, color="gray", ls="--", label="no adapter")
        ax.set(xlabel="epoch", ylabel="held-out KL(teacher‖student)", title="held-out KL")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "kl.png", dpi=100)
        plt.close(fig)
        paths.append(out / "kl.png")
    return paths
