"""Training checkpoints: LoRA adapter + optimizer state as safetensors, and a JSON with the training state.

A checkpoint is a folder:
    adapter.safetensors    blk.{layer}.{target}.lora_a [r, in] / .lora_b [out, r], float32
    optimizer.safetensors  the optimizer's arrays under the caller's names (e.g. AdamW m / v)
    checkpoint.json        format, the sha256 and size of both safetensors, and `state` (step, epoch, data
                           cursor, RNG state as plain ints/lists, metrics: anything JSON)
Every file is written to a temporary name, fsynced and renamed into place, the JSON last (and an old JSON is
removed before anything else is rewritten), so a checkpoint is complete exactly when its JSON exists and the
hashes it records match. safetensors.numpy and json only (no object deserialisation).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from data.files import atomic_write_bytes, fsync_dir
from model.config import LORA_TARGETS
from model.reference import LoraPair
from schemas.manifests import CheckpointManifest, FileRef

FORMAT = "distillery-checkpoint"
VERSION = 1
ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "checkpoint.json"

Adapter = dict[tuple[int, str], LoraPair]
_ADAPTER_KEY = re.compile(r"^blk\.(\d+)\.([a-z]+)\.lora_([ab])$")


class CheckpointError(ValueError):
    """A checkpoint is incomplete, corrupt or malformed; the message names the file and field."""


# ---------------------------------------------------------------- adapter <-> flat tensors


def adapter_key(layer: int, target: str, which: str) -> str:
    """'blk.{layer}.{target}.lora_{a|b}' (target = short name q, k, v, o, gate, up, down)."""
    return f"blk.{layer}.{target}.lora_{which}"


def adapter_tensors(adapter: Mapping[tuple[int, str], LoraPair], source: str = "adapter") -> dict[str, np.ndarray]:
    """{adapter_key: f32 array}, ordered by layer then target; checks names, dtypes and shapes."""
    order = list(LORA_TARGETS)
    out: dict[str, np.ndarray] = {}
    for key in sorted(adapter, key=lambda k: (k[0], order.index(k[1]) if k[1] in order else len(order))):
        layer, target = key
        item = f"{source}: pair {key!r}"
        if not isinstance(layer, int | np.integer) or layer < 0:
            raise CheckpointError(f"{item}: layer: {layer!r} is not a non-negative int")
        if target not in LORA_TARGETS:
            raise CheckpointError(f"{item}: target: {target!r} is not one of {order}")
        pair = adapter[key]
        a, b = np.asarray(pair.A), np.asarray(pair.B)
        for name, arr in (("A", a), ("B", b)):
            if arr.dtype != np.float32:
                raise CheckpointError(f"{item}: {name}: dtype {arr.dtype}, LoRA parameters are float32")
            if arr.ndim != 2:
                raise CheckpointError(f"{item}: {name}: shape {arr.shape} is not 2-D")
        if a.shape[0] != b.shape[1]:
            raise CheckpointError(f"{item}: shape: A {a.shape} and B {b.shape} disagree on the rank")
        out[adapter_key(int(layer), target, "a")] = np.ascontiguousarray(a)
        out[adapter_key(int(layer), target, "b")] = np.ascontiguousarray(b)
    return out


def adapter_from_tensors(tensors: Mapping[str, np.ndarray], source: str) -> Adapter:
    """Inverse of adapter_tensors; CheckpointError naming `source` and the key on a malformed entry."""
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, arr in tensors.items():
        m = _ADAPTER_KEY.match(name)
        if m is None or m[2] not in LORA_TARGETS:
            raise CheckpointError(f"{source}: tensor {name!r}: name: expected blk.N.<target>.lora_a or .lora_b")
        if arr.dtype != np.float32 or arr.ndim != 2:
            raise CheckpointError(f"{source}: tensor {name!r}: dtype/shape: {arr.dtype} {arr.shape}, want 2-D f32")
        halves.setdefault((int(m[1]), m[2]), {})[m[3]] = arr
    adapter: Adapter = {}
    for key, ab in halves.items():
        missing = [w for w in "ab" if w not in ab]
        if missing:
            raise CheckpointError(f"{source}: tensor {adapter_key(*key, missing[0])!r}: name: missing")
        if ab["a"].shape[0] != ab["b"].shape[1]:
            raise CheckpointError(
                f"{source}: pair {key!r}: shape: A {ab['a'].shape} and B {ab['b'].shape} disagree on the rank"
            )
        adapter[key] = LoraPair(A=ab["a"], B=ab["b"])
    return adapter


# ---------------------------------------------------------------- JSON state and RNG


def _check_json(value: Any, where: str) -> None:
    """Only plain JSON (dict with str keys, list/tuple, str, int, float, bool, None) may go in state."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(f"state: {where}: key {k!r} is not a str")
            _check_json(v, f"{where}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]")
    elif value is not None and not isinstance(value, str | int | float | bool):
        raise CheckpointError(
            f"state: {where}: {type(value).__name__} is not plain JSON (use int/float/list, not numpy)"
        )


def _plain(value: Any) -> Any:
    """numpy arrays/scalars inside a dict/list -> lists / Python numbers."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def rng_state(rng: np.random.Generator) -> dict[str, Any]:
    """The generator's bit-generator state as plain ints/lists (JSON-safe); rng_from_state restores it."""
    return _plain(rng.bit_generator.state)


def rng_from_state(state: Mapping[str, Any]) -> np.random.Generator:
    """A numpy Generator continuing exactly where the one `rng_state` captured left off."""
    name = state.get("bit_generator")
    if name not in ("PCG64", "PCG64DXSM", "Philox", "SFC64", "MT19937"):
        raise CheckpointError(f"state: rng.bit_generator: {name!r} is not a numpy bit generator")
    bit_gen = getattr(np.random, name)()
    bit_gen.state = dict(state)
    return np.random.Generator(bit_gen)


# ---------------------------------------------------------------- save / load


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_ref(path: Path, data: bytes, root: Path | None) -> FileRef:
    """FileRef of bytes just written to `path`; the path relative to `root` when it lies under it."""
    stored = path
    if root is not None and path.resolve().is_relative_to(root.resolve()):
        stored = path.resolve().relative_to(root.resolve())
    return FileRef(path=stored.as_posix(), sha256=_sha256(data), bytes=len(data))


def save_checkpoint(
    folder: str | Path,
    adapter: Mapping[tuple[int, str], LoraPair],
    optimizer: Mapping[str, np.ndarray],
    state: Mapping[str, Any],
    root: str | Path | None = None,
) -> CheckpointManifest:
    """Write a checkpoint into `folder` (created; an existing checkpoint there is replaced).

    state: JSON-only values, with int `step` and `epoch` >= 0 and optionally `metrics` {name: float}.
    Returns the CheckpointManifest; its paths are relative to `root` when given (e.g. the run workdir).
    """
    folder = Path(folder)
    state = dict(state)
    _check_json(state, "state")
    for field in ("step", "epoch"):
        value = state.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"{folder / STATE_FILE}: state.{field}: {value!r} is not an int >= 0")
    metrics = state.get("metrics", {})
    if not isinstance(metrics, dict) or not all(isinstance(v, int | float) for v in metrics.values()):
        raise CheckpointError(f"{folder / STATE_FILE}: state.metrics: must be a dict of numbers")
    for name, arr in optimizer.items():
        if not isinstance(name, str) or not isinstance(arr, np.ndarray):
            raise CheckpointError(f"{folder / OPTIMIZER_FILE}: tensor {name!r}: not a str -> numpy array entry")

    adapter_bytes = st_save(adapter_tensors(adapter, str(folder / ADAPTER_FILE)), {"format": FORMAT})
    optimizer_bytes = st_save({k: np.ascontiguousarray(v) for k, v in optimizer.items()}, {"format": FORMAT})

    folder.mkdir(parents=True, exist_ok=True)
    state_path = folder / STATE_FILE
    if state_path.exists():  # from here until the new JSON lands the folder is an incomplete checkpoint
        state_path.unlink()
        fsync_dir(folder)
    atomic_write_bytes(folder / ADAPTER_FILE, adapter_bytes)
    atomic_write_bytes(folder / OPTIMIZER_FILE, optimizer_bytes)
    record = {
        "format": FORMAT,
        "version": VERSION,
        "files": {
            "adapter": {"path": ADAPTER_FILE, "sha256": _sha256(adapter_bytes), "bytes": len(adapter_bytes)},
            "optimizer": {
                "path": OPTIMIZER_FILE,
                "sha256": _sha256(optimizer_bytes),
                "bytes": len(optimizer_bytes),
            },
        },
        "state": state,
    }
    state_bytes = (json.dumps(record, indent=1, sort_keys=True) + "\n").encode()
    atomic_write_bytes(state_path, state_bytes)

    base = Path(root) if root is not None else None
    return CheckpointManifest(
        epoch=state["epoch"],
        step=state["step"],
        adapter=_file_ref(folder / ADAPTER_FILE, adapter_bytes, base),
        optimizer=_file_ref(folder / OPTIMIZER_FILE, optimizer_bytes, base),
        state=_file_ref(state_path, state_bytes, base),
        metrics={k: float(v) for k, v in metrics.items()},
    )


def _read_record(folder: Path) -> dict[str, Any]:
    path = folder / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing: incomplete checkpoint (the JSON is written last)")
    try:
        record = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: json: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format: not a {FORMAT} file")
    if record.get("version") != VERSION:
        raise CheckpointError(f"{path}: version: {record.get('version')!r}, this code reads {VERSION}")
    if not isinstance(record.get("state"), dict) or not isinstance(record.get("files"), dict):
        raise CheckpointError(f"{path}: state/files: missing")
    return record


def _read_verified(folder: Path, record: Mapping[str, Any], role: str) -> bytes:
    """The bytes of the file `role` names, checked against the size and sha256 the JSON records."""
    entry = record["files"].get(role)
    json_path = folder / STATE_FILE
    if not isinstance(entry, dict) or not {"path", "sha256", "bytes"} <= entry.keys():
        raise CheckpointError(f"{json_path}: files.{role}: missing or malformed")
    name = str(entry["path"])
    if Path(name).name != name:
        raise CheckpointError(f"{json_path}: files.{role}.path: {name!r} must be a file name in the folder")
    path = folder / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (recorded in {json_path.name})")
    data = path.read_bytes()
    if len(data) != entry["bytes"]:
        raise CheckpointError(f"{path}: size: {len(data)} bytes, {json_path.name} records {entry['bytes']}")
    digest = _sha256(data)
    if digest != entry["sha256"]:
        raise CheckpointError(f"{path}: sha256: {digest} differs from {entry['sha256']} ({json_path.name}): corrupt")
    return data


def _load_safetensors(path: Path, data: bytes) -> dict[str, np.ndarray]:
    try:
        return st_load(data)
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(f"{path}: safetensors: {exc}") from None


def verify_checkpoint(folder: str | Path) -> dict[str, Any]:
    """Check the checkpoint in `folder` is complete (JSON present, both files match it); return its state."""
    folder = Path(folder)
    record = _read_record(folder)
    for role in ("adapter", "optimizer"):
        _read_verified(folder, record, role)
    return record["state"]


def load_checkpoint(folder: str | Path) -> tuple[Adapter, dict[str, np.ndarray], dict[str, Any]]:
    """(adapter, optimizer arrays, state) from `folder`, after checking every hash the JSON records.

    CheckpointError naming the file when the checkpoint is incomplete, corrupt or malformed. JSON lists come
    back as lists (tuples saved in state are not restored as tuples).
    """
    folder = Path(folder)
    record = _read_record(folder)
    adapter_path, optimizer_path = folder / ADAPTER_FILE, folder / OPTIMIZER_FILE
    adapter_data = _read_verified(folder, record, "adapter")
    optimizer_data = _read_verified(folder, record, "optimizer")
    adapter = adapter_from_tensors(_load_safetensors(adapter_path, adapter_data), str(adapter_path))
    optimizer = _load_safetensors(optimizer_path, optimizer_data)
    return adapter, optimizer, record["state"]


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """The conventional folder of the checkpoint after `step` optimizer steps: root/step-00000123."""
    return Path(root) / f"step-{step:08d}"


def latest_checkpoint(root: str | Path, max_step: int | None = None) -> Path | None:
    """The complete checkpoint under `root` (one folder level) with the highest (step, epoch), or None; with
    `max_step`, the highest at or before that step (where a recomputed epoch starts from).

    Incomplete or corrupt folders (no JSON, missing file, hash mismatch) are skipped.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    candidates = []
    for folder in root.iterdir():
        if not (folder / STATE_FILE).is_file():
            continue
        try:
            state = _read_record(folder)["state"]
            key = (int(state["step"]), int(state["epoch"]))
        except (CheckpointError, KeyError, TypeError, ValueError):
            continue
        if max_step is not None and key[0] > max_step:
            continue
        candidates.append((key, folder.name, folder))
    for _, _, folder in sorted(candidates, reverse=True):
        try:
            verify_checkpoint(folder)
        except CheckpointError:
            continue
        return folder
    return None
