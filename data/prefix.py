"""Frozen-prefix activation cache on disk: the residual stream entering block L, float16, one file per shard.

When LoRA covers only blocks >= L, the input of block L is a fixed function of the tokens (the frozen blocks
0..L-1 of the student). It is computed once per sequence and stored here; training and evaluation start their
forward at block L from it.

Layout of a cache folder:
  prefix-<split>-<shard:05d>.npy   float16 [n_seq, seq_len, hidden] of sequences [seq_start, seq_end), in order
  prefix_manifest.json             schemas.manifests.PrefixManifest (without dir): header + one row per shard
A shard counts only when the manifest lists it with the sha256 of the file renamed into place (files are
written to a temp name, fsynced, renamed; the manifest is rewritten the same way after every shard), so a crash
loses at most the shard being written. Readers verify every shard's size and sha256 before using it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data.files import atomic_file, atomic_write_text
from schemas.manifests import ManifestError, PrefixManifest, PrefixShard, sha256_file

MANIFEST_NAME = "prefix_manifest.json"
SHARD_BYTES = 64 << 20  # float16 bytes per shard file (whole sequences; at least one)
F16_MAX = float(np.finfo(np.float16).max)


class PrefixError(ManifestError):
    """A prefix-cache file is missing, corrupt, or does not match its manifest; the message names the file."""


def shard_file(split: str, shard: int) -> str:
    return f"prefix-{split}-{shard:05d}.npy"


def plan_shards(
    seq_ids: dict[str, np.ndarray], seq_len: int, hidden: int, shard_bytes: int = SHARD_BYTES
) -> list[tuple[str, int, int]]:
    """(split, seq_start, seq_end) per shard: runs of consecutive sequences of at most shard_bytes (>= 1)."""
    per = max(1, shard_bytes // (2 * seq_len * hidden))
    plans = []
    for split in ("train", "eval"):
        ids = np.asarray(seq_ids.get(split, ()), np.int64)
        if len(ids) and not (np.diff(ids) == 1).all():
            raise PrefixError(f"{split} split: seq_id must be consecutive and ascending to plan prefix shards")
        for s in range(0, len(ids), per):
            chunk = ids[s : s + per]
            plans.append((split, int(chunk[0]), int(chunk[-1]) + 1))
    return plans


def to_f16(x: np.ndarray, source: str) -> np.ndarray:
    """x as float16, refusing values float16 cannot hold (they would be stored as inf)."""
    x = np.asarray(x)
    peak = float(np.max(np.abs(x))) if x.size else 0.0
    if not np.isfinite(peak) or peak > F16_MAX:
        raise PrefixError(
            f"{source}: the residual stream reaches {peak:.3g}, beyond float16 ({F16_MAX:.0f}); "
            "set train.prefix_cache=off"
        )
    return x.astype(np.float16)


def write_shard(folder: str | Path, split: str, index: int, seq_start: int, x: np.ndarray) -> PrefixShard:
    """Write float16 x [n_seq, seq_len, hidden] of sequences [seq_start, seq_start + n_seq) atomically."""
    folder = Path(folder)
    path = folder / shard_file(split, index)
    x = to_f16(x, str(path))
    with atomic_file(path) as fh:
        np.save(fh, np.ascontiguousarray(x), allow_pickle=False)
        fh.flush()
        digest, size = sha256_file(Path(fh.name)), fh.tell()
    return PrefixShard(
        file=path.name, split=split, seq_start=seq_start, seq_end=seq_start + len(x), sha256=digest, bytes=size
    )


def write_manifest(folder: str | Path, manifest: PrefixManifest) -> None:
    """Atomically replace the folder's prefix_manifest.json (stored without dir)."""
    path = Path(folder) / MANIFEST_NAME
    atomic_write_text(path, manifest.model_copy(update={"dir": ""}).model_dump_json(indent=1))


def read_manifest(folder: str | Path) -> PrefixManifest | None:
    """The folder's manifest, or None when there is none (or it is unreadable: the cache starts over)."""
    path = Path(folder) / MANIFEST_NAME
    try:
        return PrefixManifest.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def verify_shard(folder: str | Path, shard: PrefixShard) -> Path:
    """The shard's path after checking its size and sha256 against the manifest row; PrefixError otherwise."""
    path = Path(folder) / shard.file
    if not path.is_file():
        raise PrefixError(f"{path}: prefix shard missing")
    if path.stat().st_size != shard.bytes:
        raise PrefixError(f"{path}: corrupt prefix shard: {path.stat().st_size} bytes, manifest says {shard.bytes}")
    digest = sha256_file(path)
    if digest != shard.sha256:
        raise PrefixError(f"{path}: corrupt prefix shard: sha256 {digest}, manifest says {shard.sha256}")
    return path


class PrefixReader:
    """Rows of a complete, verified prefix cache by seq_id, as float32 [n, seq_len, hidden]."""

    def __init__(self, folder: str | Path, manifest: PrefixManifest | None = None) -> None:
        self.folder = Path(folder)
        found = read_manifest(self.folder)
        if found is None:
            raise PrefixError(f"{self.folder / MANIFEST_NAME}: no prefix-cache manifest")
        if manifest is not None and found.model_copy(update={"dir": ""}) != manifest.model_copy(update={"dir": ""}):
            raise PrefixError(f"{self.folder / MANIFEST_NAME}: differs from the prefix manifest given")
        self.manifest = found
        self._arrays: list[np.ndarray | None] = [None] * len(found.shards)
        self._starts = np.array([s.seq_start for s in found.shards], np.int64)
        self._ends = np.array([s.seq_end for s in found.shards], np.int64)
        order = np.argsort(self._starts)
        self._starts, self._ends, self._order = self._starts[order], self._ends[order], order

    def _shard(self, i: int) -> np.ndarray:
        if self._arrays[i] is None:
            shard = self.manifest.shards[i]
            path = verify_shard(self.folder, shard)
            x = np.load(path, mmap_mode="r", allow_pickle=False)
            want = (shard.seq_end - shard.seq_start, self.manifest.seq_len, self.manifest.hidden)
            if x.dtype != np.float16 or x.shape != want:
                raise PrefixError(f"{path}: {x.dtype} {x.shape}, the manifest says float16 {want}")
            self._arrays[i] = x
        return self._arrays[i]  # type: ignore[return-value]

    def read(self, seq_ids: Sequence[int]) -> np.ndarray:
        """float32 [len(seq_ids), seq_len, hidden]: the cached block-L input of each sequence, in order."""
        m = self.manifest
        out = np.empty((len(seq_ids), m.seq_len, m.hidden), np.float32)
        for j, sid in enumerate(seq_ids):
            pos = int(np.searchsorted(self._starts, sid, side="right")) - 1
            if pos < 0 or sid >= self._ends[pos]:
                raise PrefixError(f"{self.folder}: sequence {sid} is not in the prefix cache")
            i = int(self._order[pos])
            out[j] = self._shard(i)[sid - m.shards[i].seq_start]
        return out
