"""export_adapter: the best checkpoint as a PEFT dir, a GGUF LoRA adapter, and optionally a merged GGUF."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from data.adapters import export_gguf_lora, export_peft, merge_adapter
from data.checkpoint import load_checkpoint
from model.gguf import GGUFFile
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest, ExportManifest, FileRef
from tasks.caching import (
    StageCache,
    as_config,
    located,
    missing,
    relative,
    stage_dir,
    stage_options,
    workdir,
)
from tasks.student import student_path

PEFT_DIR = "peft"
GGUF_LORA = "adapter-lora.gguf"
MERGED = "merged.gguf"


def _outputs_problem(cfg: RunConfig, inputs: Mapping[str, Any], key: str) -> str | None:
    out = stage_dir(cfg, "export", key)
    wanted = (
        (cfg.export.peft, out / PEFT_DIR),
        (cfg.export.gguf_lora, out / GGUF_LORA),
        (cfg.export.merge, out / MERGED),
    )
    return missing(*(path for on, path in wanted if on))


POLICY = StageCache(
    stage="export",
    version="1",
    config_fields=("lora", "export"),
    inputs=("student", "checkpoint"),
    outputs_problem=_outputs_problem,
)


def base_model_name(path: Path) -> str:
    """The base adapter_config.json names: the GGUF's HF repo if recorded, else its name, else the file."""
    with GGUFFile(path) as f:
        md = f.metadata
    for key in ("general.source.huggingface.repository", "general.base_model.0.repo_url", "general.name"):
        value = md.get(key)
        if isinstance(value, str) and value:
            return value
    return path.stem


@task(**stage_options(POLICY, task_run_name="export"))
def export_adapter(cfg: RunConfig, student: dict[str, Any], checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Returns {"dir", "manifest": ExportManifest, "peft_dir", "gguf_lora", "merged": {"path", "manifest"},
    "merge_report": error statistics of the merge}; paths relative to the workdir."""
    cfg = as_config(cfg)
    log = get_run_logger()
    root = workdir(cfg)
    out = stage_dir(cfg, "export", POLICY.key(cfg, {"student": student, "checkpoint": checkpoint}))
    out.mkdir(parents=True, exist_ok=True)
    base = student_path(cfg, student)
    ckpt = CheckpointManifest.model_validate(checkpoint["manifest"])
    adapter, _, _ = load_checkpoint(located(cfg, checkpoint["dir"]))
    with GGUFFile(base) as f:
        mcfg = f.config()
    result: dict[str, Any] = {"dir": relative(cfg, out)}
    peft = gguf_lora = merged = None
    if cfg.export.peft:
        files = export_peft(
            adapter,
            mcfg,
            cfg.lora.r,
            cfg.lora.alpha,
            cfg.lora.targets,
            out / PEFT_DIR,
            base_model_name(base),
            layers=cfg.lora.layers,
        )
        peft = tuple(FileRef.of(p.resolve(), root) for p in files)
        result["peft_dir"] = relative(cfg, out / PEFT_DIR)
    if cfg.export.gguf_lora:
        gguf_lora = FileRef.of(export_gguf_lora(adapter, base, cfg.lora.alpha, out / GGUF_LORA).resolve(), root)
        result["gguf_lora"] = gguf_lora.path
    if cfg.export.merge:
        report = merge_adapter(base, adapter, cfg.lora.scale, out / MERGED, quant=cfg.export.merge_quant)
        merged = FileRef.of((out / MERGED).resolve(), root)
        result["merged"] = {"path": merged.path, "manifest": merged.model_dump(mode="json")}
        result["merge_report"] = {k: report[k] for k in ("merged", "error_rms", "error_max", "delta_rms")}
    manifest = ExportManifest(epoch=ckpt.epoch, step=ckpt.step, peft=peft, gguf_lora=gguf_lora, merged=merged)
    log.info("exported epoch %d (step %d) to %s", ckpt.epoch, ckpt.step, out)
    return {**result, "manifest": manifest.model_dump(mode="json")}
