"""Content keys of the pipeline's stages: what a stage's output depends on, hashed.

A stage's key is the sha256 of: the stage name and its code version, the config fields the stage reads
(schemas.config_fingerprint), the sha256 of the model files it reads (memoised by path, size and mtime in
<workdir>/.cache/sha256.json), the dataset fingerprint when it reads the data, and the content of its upstream
manifests (locations and run-time measurements dropped, so only hashes, counts and values count: a moved
workdir with the same content keeps its keys). A stage writes into the folder its key addresses
(stages.layout.stage_dir); tasks/caching.py uses the same key as the Prefect cache key.

`outputs_problem` verifies a cached result before it is reused: every file its manifest lists (outputs()) on
disk with the recorded size and sha256, plus format-level checks for the files a manifest does not hash (a
token split's datasets metadata). Files up to VERIFY_FULL_BYTES are hashed at every check; a larger one through
the memo, so it is re-read only when its size or mtime changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.records import dataset_fingerprint
from schemas.config import RunConfig, config_fingerprint
from schemas.manifests import Manifest, ManifestError, TokenizeManifest, sha256_file
from stages.layout import workdir

MEMO_FILE = Path(".cache") / "sha256.json"
VERIFY_FULL_BYTES = 64 << 20
# Never part of a key: locations (paths, dirs), and what a checkpoint records about the run that wrote it
# (metrics with timings, the state JSON holding them, the optimizer moments): a checkpoint counts by its
# adapter.
IGNORED_KEYS = frozenset({"path", "dir", "metrics", "state", "optimizer"})
_memo_lock = threading.Lock()


# ---------------------------------------------------------------------------------------------- file hashes


def file_sha256(path: str | Path, memo_root: str | Path) -> str:
    """sha256 of a file, memoised in <memo_root>/.cache/sha256.json by (absolute path, size, mtime_ns)."""
    path = Path(path).expanduser().resolve()
    st = path.stat()
    memo_path = Path(memo_root) / MEMO_FILE
    entry_key = str(path)
    with _memo_lock:
        memo = _read_memo(memo_path)
        hit = memo.get(entry_key)
        if hit and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
            return str(hit["sha256"])
    digest = sha256_file(path)
    with _memo_lock:
        memo = _read_memo(memo_path)
        memo[entry_key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f".{memo_path.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(json.dumps(memo, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, memo_path)
    return digest


def _read_memo(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------------------------------------- keys


def content(value: Any) -> Any:
    """JSON-able content of a manifest (or a list of them, or a plain value), for keys: IGNORED_KEYS dropped."""
    if hasattr(value, "model_dump"):
        unkeyed = getattr(value, "UNKEYED_DEFAULTS", {})  # fields added later: at their default, keys stay put
        value = {k: v for k, v in value.model_dump(mode="json").items() if k not in unkeyed or unkeyed[k] != v}
    if isinstance(value, Mapping):
        return {str(k): content(v) for k, v in value.items() if k not in IGNORED_KEYS}
    if isinstance(value, list | tuple):
        return [content(v) for v in value]
    if isinstance(value, Path):
        raise TypeError(f"a bare Path ({value}) cannot be part of a cache key: hash the file's content")
    return value


@dataclass(frozen=True)
class StageKey:
    """What one stage's output depends on; `key` hashes it (see the module docstring).

    config_fields: dotted config fields the stage reads (values, never paths).
    config_fields_when: (field, value, fields) folded in only while field == value.
    files: dotted config fields naming files the stage reads, hashed by content (e.g. "model.student").
    dataset: fold in data.records.dataset_fingerprint of cfg.data (data.path, and data.eval_path when set).
    inputs: upstream values folded in by content (manifests, an epoch number, a shard plan), by name.
    """

    stage: str
    version: str = "1"
    config_fields: tuple[str, ...] = ()
    # (field, value, more fields): the more fields are folded in only while field == value (options added later,
    # so that the keys of runs without them stay put)
    config_fields_when: tuple[tuple[str, Any, tuple[str, ...]], ...] = ()
    files: tuple[str, ...] = ()
    dataset: bool = False
    inputs: tuple[str, ...] = ()

    def key(self, cfg: RunConfig, inputs: Mapping[str, Any]) -> str:
        """The stage's key: '<stage>-<sha256>'. Inputs named in `inputs` but absent are left out."""
        root = workdir(cfg)
        parts: dict[str, Any] = {
            "stage": self.stage,
            "version": self.version,
            "config": config_fingerprint(cfg, self.config_fields),
        }
        for field, value, more in self.config_fields_when:
            if _field(cfg, field) == value:
                parts[f"config:{field}={value}"] = config_fingerprint(cfg, more)
        for name in self.files:
            parts[f"file:{name}"] = file_sha256(_field(cfg, name), root)
        if self.dataset:
            d = cfg.data
            parts["dataset"] = dataset_fingerprint(d.path, d.format, d.text_field, d.messages_field, d.max_documents)
            if d.eval_path is not None:  # held out by source (absent: the keys of earlier runs stay put)
                parts["eval_dataset"] = dataset_fingerprint(
                    d.eval_path, d.format, d.text_field, d.messages_field, d.max_documents
                )
        for name in self.inputs:
            if name in inputs:
                parts[f"input:{name}"] = content(inputs[name])
        canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), allow_nan=True)
        return f"{self.stage}-{hashlib.sha256(canonical.encode()).hexdigest()}"


def _field(cfg: RunConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


# ---------------------------------------------------------------------------------------------- verification


def verified_sha256(path: Path, memo_root: str | Path) -> str:
    """sha256 for verification: read in full up to VERIFY_FULL_BYTES, through the memo above that."""
    if path.stat().st_size <= VERIFY_FULL_BYTES:
        return sha256_file(path)
    return file_sha256(path, memo_root)


def outputs_problem(cfg: RunConfig, manifest: Manifest) -> str | None:
    """None when the files a stage result stands for verify on disk; else one line naming the file and what
    differs (missing, size, sha256, unreadable metadata)."""
    root = workdir(cfg)
    try:
        for ref in manifest.outputs():
            ref.verify(root, sha256=lambda p: verified_sha256(p, root))
    except ManifestError as exc:
        return str(exc)
    if isinstance(manifest, TokenizeManifest):
        return token_splits_problem(manifest, root)
    return None


def token_splits_problem(manifest: TokenizeManifest, root: Path) -> str | None:
    """Format-level check of the datasets metadata next to each split's .arrow files (not hashed: it holds a
    random fingerprint): state.json lists exactly the manifest's files, dataset_info.json has the columns."""
    for split in ("train", "eval"):
        refs = getattr(manifest, split).shards
        if not refs:
            continue
        folder = refs[0].resolve(root).parent
        try:
            state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
            info = json.loads((folder / "dataset_info.json").read_text(encoding="utf-8"))
            listed = sorted(str(f["filename"]) for f in state["_data_files"])
            columns = set(info["features"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"{folder}: unreadable datasets metadata ({type(exc).__name__}: {exc})"
        if listed != sorted(ref.resolve(root).name for ref in refs):
            return f"{folder / 'state.json'}: lists {listed}, the manifest has {len(refs)} other files"
        if not {"input_ids", "loss_mask"} <= columns:
            return f"{folder / 'dataset_info.json'}: columns {sorted(columns)} lack input_ids/loss_mask"
    return None
