"""The tiny KD and DPO pipelines through the CLI in a fresh workdir, every output file hashed (a refactor's proof).

    python -m tests.bitwise_pipeline OUT.json          # runs both flows, writes {kind: {relative path: sha256}}
    python -m tests.bitwise_pipeline --compare A.json B.json

Token shards, teacher shards, every checkpoint, PEFT, GGUF LoRA and merged GGUF are hashed (DPO: pairs, reference
log-probs, checkpoints, exports); JSON files without their timings (TIMINGS), the resolved config with the run's
folder replaced. Records, reports, Prefect and MLflow state hold times, names and ids and are left out (SKIP).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from schemas.manifests import sha256_file
from tests.pipeline_fixtures import tiny_config, write_texts, write_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "prefs.jsonl"
SKIP = (".cache", ".prefect", "mlflow.db", "mlartifacts", "mlruns", "logs", "reports", "report.md")
TIMINGS = ("tokens_per_s", "seconds", "pairs_per_s")  # keys of measured times and rates in JSON files


def _dpo_config(workdir: Path, model: Path) -> dict:
    return {
        "model": {"student": str(model), "student_quant": ["Q4_0"]},
        "data": {"path": str(shutil.copy(EXAMPLE, workdir.parent)), "seq_len": 80, "eval_fraction": 0.25},
        "lora": {"r": 4, "alpha": 8.0, "targets": ["q", "v", "down"]},
        "optim": {"lr": 5e-3, "warmup_steps": 1},
        "train": {"epochs": 2, "batch_size": 4, "max_steps_per_epoch": 3, "backend": "numpy"},
        "preference": {"beta": 0.5},
        "run": {"workdir": str(workdir), "experiment": "tiny-dpo", "task": "dpo"},
    }


def _run(config: dict, folder: Path) -> dict[str, str]:
    """`distillery run` on `config` (a fresh workdir, Prefect home under it); {relative file: sha256}."""
    path = folder / f"{config['run']['experiment']}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DISTILLERY_FAULT"))}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(path)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(proc.stdout + proc.stderr)
    work = Path(config["run"]["workdir"])
    return {
        str(p.relative_to(work)): _digest(p, folder)
        for p in sorted(work.rglob("*"))
        if p.is_file() and p.relative_to(work).parts[0] not in SKIP
    }


def _untimed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k not in TIMINGS}
    return [_untimed(v) for v in value] if isinstance(value, list) else value


def _digest(path: Path, folder: Path) -> str:
    """sha256 of the file; of JSON (lines) without TIMINGS; of YAML with `folder` written as '<folder>'."""
    if path.suffix in (".json", ".jsonl"):
        text = path.read_text()
        rows = (
            [json.loads(line) for line in text.splitlines() if line.strip()]
            if path.suffix == ".jsonl"
            else json.loads(text)
        )
        return "json:" + hashlib.sha256(json.dumps(_untimed(rows), sort_keys=True).encode()).hexdigest()
    if path.suffix == ".yaml":
        return "yaml:" + hashlib.sha256(path.read_text().replace(str(folder), "<folder>").encode()).hexdigest()
    return sha256_file(path)


def run_both() -> dict[str, dict[str, str]]:
    """Both flows on freshly written tiny inputs (fixed seeds: the same bytes every time)."""
    folder = Path(tempfile.mkdtemp(prefix="distillery-bitwise-"))
    kd = tiny_config(folder / "kd")  # its inputs written again under `folder` (the same seeds, the same bytes)
    kd["model"]["student"] = kd["model"]["teacher"] = str(write_tiny_llama(folder / "teacher-f32.gguf"))
    kd["data"]["path"] = str(write_texts(folder / "texts.jsonl"))
    model = write_tiny_llama(folder / "tiny128.gguf", context_length=128)
    return {"kd": _run(kd, folder), "dpo": _run(_dpo_config(folder / "dpo", model), folder)}


def compare(a: dict[str, dict[str, str]], b: dict[str, dict[str, str]]) -> list[str]:
    """Lines naming every file that differs, is missing or is new."""
    out = []
    for kind in sorted(set(a) | set(b)):
        x, y = a.get(kind, {}), b.get(kind, {})
        out += [f"{kind}: {f}: {x.get(f)} != {y.get(f)}" for f in sorted(set(x) | set(y)) if x.get(f) != y.get(f)]
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compare"]:
        a, b = (json.loads(Path(p).read_text()) for p in argv[1:3])
        diff = compare(a, b)
        print("\n".join(diff) or f"bitwise equal: {sum(len(v) for v in a.values())} files")
        return 1 if diff else 0
    hashes = run_both()
    Path(argv[0]).write_text(json.dumps(hashes, indent=1, sort_keys=True))
    print({kind: len(files) for kind, files in hashes.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
