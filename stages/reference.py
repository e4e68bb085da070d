"""reference: per-pair summed response log-probs under the frozen reference, as Parquet (run.task: dpo).

The reference is the student without an adapter (the requantized student of the student stage: the policy at
step 0) or preference.reference, another GGUF with the same vocabulary. One row per pair of both splits
(schemas.preferences.REFERENCE_SCHEMA), written atomically, its sha256 in the manifest; the folder is addressed
by the content key (the reference's sha256, the tokenized pairs, the batch shape), so it is computed once.
Skipped when preference.reference_free (SimPO).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data.atomic import atomic_file
from data.preferences import read_pair_rows
from schemas.config import RunConfig
from schemas.manifests import FileRef, ManifestError, StudentManifest
from schemas.preferences import REFERENCE_SCHEMA, PairsManifest, ReferenceManifest
from stages.keys import StageKey, file_sha256
from stages.layout import stage_dir, workdir
from stages.progress import BarFactory, no_bar

log = logging.getLogger(__name__)

FOLDER = "reference"
FILE = "reference.parquet"
KEY = StageKey(
    stage="preference-reference",
    version="1",
    config_fields=("train.batch_size",),
    inputs=("pairs", "reference"),
)


def reference_gguf(cfg: RunConfig, student: StudentManifest) -> tuple[Path, str, str]:
    """(the reference GGUF, its sha256, 'student' | 'file')."""
    root = workdir(cfg)
    if cfg.preference.reference is None:
        return student.path_in(root), student.file.sha256, "student"
    return Path(cfg.preference.reference), file_sha256(cfg.preference.reference, root), "file"


def key_inputs(cfg: RunConfig, student: StudentManifest, pairs: PairsManifest) -> dict:
    """What KEY folds in: the tokenized pairs and the reference GGUF's sha256."""
    return {"pairs": pairs, "reference": reference_gguf(cfg, student)[1]}


def run(cfg: RunConfig, student: StudentManifest, pairs: PairsManifest, bar: BarFactory = no_bar) -> ReferenceManifest:
    """Log-probs of every pair's chosen and rejected response under the reference, both splits."""
    from training.preference import reference_logps

    root = workdir(cfg)
    gguf, sha, kind = reference_gguf(cfg, student)
    out = stage_dir(cfg, FOLDER, KEY.key(cfg, key_inputs(cfg, student, pairs)))
    columns: dict[str, list] = {name: [] for name in REFERENCE_SCHEMA.names}
    for split, ref in (("train", pairs.train), ("eval", pairs.eval)):
        rows = read_pair_rows(ref.verify(root))
        with bar(f"reference {split}", len(rows)) as b:
            values = reference_logps(cfg, gguf, rows, pairs.seq_len, lambda n: b.advance(n))
        columns["split"] += [split] * len(rows)
        columns["pair_id"] += rows.pair_id
        for name, v in zip(REFERENCE_SCHEMA.names[2:], values, strict=True):
            columns[name] += v.tolist()
    table = pa.table(columns, schema=REFERENCE_SCHEMA)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / FILE) as fh:
        pq.write_table(table, fh)
    log.info("reference log-probs (%s %s): %d pairs -> %s", kind, gguf.name, table.num_rows, out / FILE)
    manifest = ReferenceManifest(
        reference_sha256=sha, reference=kind, file=FileRef.of((out / FILE).resolve(), root), n_pairs=table.num_rows
    )
    return manifest.at(out, root)


def read(cfg: RunConfig, manifest: ReferenceManifest, split: str, pair_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(chosen logp, rejected logp) of `pair_ids` of `split`, in that order, from a verified reference file."""
    path = manifest.file.verify(workdir(cfg))
    table = pq.read_table(path, schema=REFERENCE_SCHEMA).to_pydict()
    by_id = {
        pid: (c, r)
        for s, pid, c, r in zip(
            table["split"], table["pair_id"], table["chosen_logp"], table["rejected_logp"], strict=True
        )
        if s == split
    }
    missing = [pid for pid in pair_ids if pid not in by_id]
    if missing:
        raise ManifestError(f"{path}: no reference log-probs for {split} pairs {missing[:5]}")
    values = np.array([by_id[pid] for pid in pair_ids], np.float64).reshape(-1, 2)
    return values[:, 0], values[:, 1]
