"""export: the best checkpoint as a PEFT dir, a GGUF LoRA adapter, and optionally a merged GGUF.

Written into <workdir>/export/<key>, addressed by the export key (the LoRA and export settings, the student
and the checkpoint's adapter).
"""

from __future__ import annotations

import logging
from pathlib import Path

from data.adapters import export_gguf_lora, export_peft, merge_adapter
from data.checkpoint import load_checkpoint
from model.gguf import GGUFFile
from schemas.config import RunConfig
from schemas.manifests import CheckpointManifest, ExportManifest, FileRef, StudentManifest
from stages.keys import StageKey
from stages.layout import stage_dir, workdir

log = logging.getLogger(__name__)

FOLDER = "export"
PEFT_DIR = "peft"
GGUF_LORA = "adapter-lora.gguf"
MERGED = "merged.gguf"
KEY = StageKey(stage="export", version="1", config_fields=("lora", "export"), inputs=("student", "checkpoint"))


def output_dir(cfg: RunConfig, key: str) -> Path:
    """<workdir>/export/<key>."""
    return stage_dir(cfg, FOLDER, key)


def wanted(cfg: RunConfig, out: Path) -> list[Path]:
    """The files and folders cfg.export asks for in export folder `out`."""
    asked = (
        (cfg.export.peft, out / PEFT_DIR),
        (cfg.export.gguf_lora, out / GGUF_LORA),
        (cfg.export.merge, out / MERGED),
    )
    return [path for on, path in asked if on]


def base_model_name(path: Path) -> str:
    """The base adapter_config.json names: the GGUF's HF repo if recorded, else its name, else the file."""
    with GGUFFile(path) as f:
        md = f.metadata
    for key in ("general.source.huggingface.repository", "general.base_model.0.repo_url", "general.name"):
        value = md.get(key)
        if isinstance(value, str) and value:
            return value
    return path.stem


def run(cfg: RunConfig, student: StudentManifest, checkpoint: CheckpointManifest) -> ExportManifest:
    """Write what cfg.export asks for from the checkpoint's adapter on the student."""
    root = workdir(cfg)
    out = output_dir(cfg, KEY.key(cfg, {"student": student, "checkpoint": checkpoint}))
    out.mkdir(parents=True, exist_ok=True)
    base = student.path_in(root)
    adapter, _, _ = load_checkpoint(checkpoint.path_in(root))
    with GGUFFile(base) as f:
        mcfg = f.config()
    peft = gguf_lora = merged = report = None
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
    if cfg.export.gguf_lora:
        gguf_lora = FileRef.of(export_gguf_lora(adapter, base, cfg.lora.alpha, out / GGUF_LORA).resolve(), root)
    if cfg.export.merge:
        fold = cfg.lora.kind == "mergeable"  # B A folds exactly into the blocks (model/fold.py) unless merge_quant
        merge = merge_adapter(base, adapter, cfg.lora.scale, out / MERGED, quant=cfg.export.merge_quant, fold=fold)
        merged = FileRef.of((out / MERGED).resolve(), root)
        keys = ("merged", "error_rms", "error_max", "delta_rms", "fold", "file_bytes", "base_file_bytes")
        report = {k: float(merge[k]) for k in keys}
        log.info(
            "merged GGUF (%s): %.3fx the student's %d bytes, error rms %.3g (update rms %.3g)",
            "folded" if merge["fold"] else "re-quantized",
            merge["file_bytes"] / merge["base_file_bytes"],
            merge["base_file_bytes"],
            merge["error_rms"],
            merge["delta_rms"],
        )
    log.info("exported epoch %d (step %d) to %s", checkpoint.epoch, checkpoint.step, out)
    manifest = ExportManifest(
        epoch=checkpoint.epoch, step=checkpoint.step, peft=peft, gguf_lora=gguf_lora, merged=merged, merge_report=report
    )
    return manifest.at(out, root)
