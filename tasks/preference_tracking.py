"""MLflow record of a preference run (run.task: dpo): one MLflow run per flow run, as tasks/tracking.py does for
distillation (params = the flattened config, tags = Prefect ids, git commit, model sha256s; metrics = every
step, per-epoch train metrics, held-out preference metrics of the baseline and each epoch, the best; artifacts
= config, report.md and the selected adapter), and the summary the CLI prints."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from schemas.config import RunConfig
from schemas.preferences import PairsManifest, PreferenceEvalManifest, ReferenceManifest
from stages.layout import workdir
from tasks.caching import as_config, stage_states
from tasks.tracking import (
    FlowRunRecord,
    client_for,
    create_flow_run,
    failed_on_error,
    log_config,
    log_steps,
    manifest_json,
    report_paths,
    summary_header,
)

STEPS_FILE = "steps.jsonl"


class PreferenceRecord(FlowRunRecord):
    """What a preference flow run produced and its MLflow run."""

    def __init__(self, cfg: RunConfig, client: Any, run_id: str, experiment_id: str, flow_run: Any) -> None:
        super().__init__(cfg, client, run_id, experiment_id, flow_run)
        self.pairs: PairsManifest | None = None
        self.reference: ReferenceManifest | None = None
        self.baseline: PreferenceEvalManifest | None = None
        self.evals: list[PreferenceEvalManifest] = []

    def _steps(self) -> list[dict[str, Any]]:
        import json

        if not self.checkpoints:
            return []
        path = self.checkpoints[-1].path_in(workdir(self.cfg)).parent / STEPS_FILE
        by_step: dict[int, dict[str, Any]] = {}
        for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
            try:
                row = json.loads(line)
                by_step[int(row["step"])] = row
            except (ValueError, KeyError, TypeError):
                continue
        return [by_step[s] for s in sorted(by_step)]

    def summary(self) -> dict[str, Any]:
        states = stage_states(self.flow_run_id)
        best = None if self.best is None else self.evals[self.best]
        return {
            "task": "dpo",
            **summary_header(self, states),
            "pairs": manifest_json(self.pairs),
            "reference": manifest_json(self.reference),
            "checkpoints": [manifest_json(c) for c in self.checkpoints],
            "preference": {
                "baseline": manifest_json(self.baseline),
                "evals": [manifest_json(e) for e in self.evals],
                "best_epoch": None if best is None else best.epoch,
                "best": manifest_json(best),
            },
            "baseline": None,  # the distillation table's slot: nothing to show for a preference run
            "export": manifest_json(self.exported),
            "files": {} if self.exported is None else self.exported.files(),
            "workdir": str(workdir(self.cfg)),
            "seconds": time.perf_counter() - self.started,
        }

    def finish(self) -> dict[str, Any]:
        """Log steps, epoch and held-out metrics, report.md and the selected adapter; end the MLflow run."""
        root = workdir(self.cfg)
        if self.student is not None:
            self.client.set_tag(self.id, "student.sha256", self.student.file.sha256)
        if self.reference is not None:
            self.client.set_tag(self.id, "reference.sha256", self.reference.reference_sha256)
        steps = self._steps()
        if steps:
            log_steps(self.client, self.id, steps)
        for ckpt in self.checkpoints:
            self._metrics({f"epoch/{k}": v for k, v in ckpt.metrics.items()}, step=ckpt.epoch)
        if self.baseline is not None:
            self._metrics({f"baseline/{k}": v for k, v in self.baseline.metrics().items()})
        for ev in self.evals:
            self._metrics({f"eval/{k}": v for k, v in ev.metrics().items()}, step=ev.epoch or 0)
        if self.best is not None:
            self._metrics({f"best/{k}": v for k, v in self.evals[self.best].metrics().items()})
            self._metrics({"best/epoch": float(self.best)})
        summary = self.summary()
        report, _ = report_paths(root, self.flow_run_name)
        report.write_text(render_report(summary), encoding="utf-8")
        summary["report"] = str(report)
        self.client.log_artifact(self.id, str(report), "report")
        files = summary["files"]
        self._log_adapter(files)
        if files and self.best is not None:
            best = self.evals[self.best]
            tags = {
                "task": "dpo",
                "epoch": str(best.epoch),
                "loss": f"{best.loss:.6g}",
                "reward_accuracy": f"{best.reward_accuracy:.6g}",
            }
            summary["registered_model"] = self._register_adapter("LoRA adapters trained by distillery", tags)
        self.client.set_terminated(self.id, "FINISHED")
        return summary


def _row(label: str, ev: Mapping[str, Any] | None) -> str:
    if ev is None:
        return f"| {label} | – | – | – | – |"
    acc, kl = 100 * ev["reward_accuracy"], ev["kl_reference"]
    return f"| {label} | {ev['loss']:.4f} | {acc:.1f}% | {ev['margin']:.4f} | {kl:.5f} |"


def table_rows(s: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any] | None]]:
    """(label, held-out metrics) rows: the baseline, then every epoch (the best one marked)."""
    p = s.get("preference") or {}
    rows: list[tuple[str, Mapping[str, Any] | None]] = [("before: no adapter", p.get("baseline"))]
    for ev in p.get("evals") or []:
        mark = " (best)" if ev["epoch"] == p.get("best_epoch") else ""
        rows.append((f"epoch {ev['epoch']}{mark}", ev))
    return rows


def render_report(s: Mapping[str, Any]) -> str:
    """report.md of a preference run: held-out loss, reward accuracy, margin and KL to the reference."""
    lines = [f"# distillery preference run `{s['flow_run_name']}`", ""]
    lines += [
        "| student | preference loss | reward accuracy | margin | KL(policy‖reference) |",
        "|---|---|---|---|---|",
    ]
    lines += [_row(label, ev) for label, ev in table_rows(s)]
    stages = s.get("stages", {})
    lines += [
        "",
        f"Stages run: {', '.join(stages.get('ran', [])) or 'none'}  ",
        f"Stages cached: {', '.join(stages.get('cached', [])) or 'none'}",
        "",
    ]
    for key, value in (s.get("files") or {}).items():
        lines.append(f"- {key}: `{value}`")
    ml = s["mlflow"]
    lines += ["", f"MLflow: run `{ml['run_id']}` in `{ml['tracking_uri']}` — {ml['url']}", ""]
    return "\n".join(lines)


@contextmanager
def preference_run(cfg: RunConfig) -> Iterator[PreferenceRecord]:
    """Start the flow run's MLflow run (params, tags, config); mark it FAILED if the block raises."""
    from prefect.runtime import flow_run

    cfg = as_config(cfg)
    client = client_for(cfg)
    experiment_id, run_id = create_flow_run(cfg, client, flow_run, task="dpo")
    record = PreferenceRecord(cfg, client, run_id, experiment_id, flow_run)
    with failed_on_error(client, run_id):
        log_config(cfg, client, run_id)
        yield record
