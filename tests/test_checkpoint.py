"""Checkpoints: bitwise round trip; corrupt or incomplete checkpoints are detected and skipped."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data.checkpoint import (
    ADAPTER_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    rng_from_state,
    rng_state,
    save_checkpoint,
)
from model import reference as R
from model.config import ModelConfig

CFG = ModelConfig(n_layers=2, hidden=32, ffn=64, n_heads=4, n_kv_heads=2, vocab=50)


def _adapter(seed: int) -> dict[tuple[int, str], R.LoraPair]:
    adapter = R.init_lora(CFG, ["q", "v", "down"], r=4, seed=seed)
    rng = np.random.default_rng(seed + 100)
    for pair in adapter.values():  # B non-zero, with values that only survive a bit-exact write
        pair.B[...] = rng.standard_normal(pair.B.shape).astype(np.float32) * np.float32(1 / 3)
    return adapter


def _optimizer(adapter: dict[tuple[int, str], R.LoraPair]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    opt: dict[str, np.ndarray] = {"step": np.array([12], dtype=np.int64)}
    for (layer, t), pair in adapter.items():
        for which, arr in (("a", pair.A), ("b", pair.B)):
            opt[f"m.blk.{layer}.{t}.lora_{which}"] = rng.standard_normal(arr.shape).astype(np.float32)
            opt[f"v.blk.{layer}.{t}.lora_{which}"] = rng.random(arr.shape, dtype=np.float32) * 1e-6
    return opt


def _state(step: int, epoch: int = 0) -> dict:
    rng = np.random.default_rng(123)
    rng.random(5)  # advance it: the state to restore is mid-stream
    return {
        "step": step,
        "epoch": epoch,
        "cursor": {"shard": 3, "row": 17, "order": [4, 0, 2, 1, 3]},
        "rng": rng_state(rng),
        "metrics": {"loss": 1.25, "grad_norm": 0.5, "skipped": 0},
    }


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_round_trip_is_bitwise(tmp_path: Path) -> None:
    adapter, state = _adapter(0), _state(12)
    opt = _optimizer(adapter)
    folder = checkpoint_dir(tmp_path, 12)
    manifest = save_checkpoint(folder, adapter, opt, state, root=tmp_path)

    adapter2, opt2, state2 = load_checkpoint(folder)
    assert adapter2.keys() == adapter.keys()
    for key, pair in adapter.items():
        assert _same_bits(adapter2[key].A, pair.A) and _same_bits(adapter2[key].B, pair.B), key
    assert opt2.keys() == opt.keys() and all(_same_bits(opt2[k], v) for k, v in opt.items())
    assert state2 == state

    # the manifest describes the files on disk (paths relative to root), the JSON records the same hashes
    assert (manifest.step, manifest.epoch, manifest.metrics["loss"]) == (12, 0, 1.25)
    for ref in (manifest.adapter, manifest.optimizer, manifest.state):
        assert not Path(ref.path).is_absolute()
        ref.verify(tmp_path)
    files = json.loads((folder / STATE_FILE).read_text())["files"]
    assert files["adapter"]["sha256"] == manifest.adapter.sha256
    assert files["optimizer"]["sha256"] == manifest.optimizer.sha256


def test_rng_state_resumes_the_stream() -> None:
    for bit_generator in (np.random.PCG64, np.random.MT19937):
        rng = np.random.Generator(bit_generator(5))
        rng.standard_normal(3)
        saved = json.loads(json.dumps(rng_state(rng)))  # through JSON, as in a checkpoint
        expected = rng.integers(0, 2**31, 8)
        assert np.array_equal(rng_from_state(saved).integers(0, 2**31, 8), expected)


def test_rewrite_in_place_replaces_the_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "ck", _adapter(0), {}, _state(1))
    save_checkpoint(tmp_path / "ck", _adapter(1), {}, _state(2, epoch=1))
    adapter, opt, state = load_checkpoint(tmp_path / "ck")
    assert state["step"] == 2 and opt == {}
    assert _same_bits(adapter[(0, "q")].B, _adapter(1)[(0, "q")].B)


@pytest.mark.parametrize("victim", [ADAPTER_FILE, OPTIMIZER_FILE])
def test_flipped_byte_is_detected(tmp_path: Path, victim: str) -> None:
    adapter = _adapter(0)
    save_checkpoint(tmp_path, adapter, _optimizer(adapter), _state(3))
    path = tmp_path / victim
    data = bytearray(path.read_bytes())
    data[len(data) - 5] ^= 0x01  # a tensor byte near the end: still a valid safetensors file
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{victim}: sha256: .*corrupt"):
        load_checkpoint(tmp_path)


def test_missing_truncated_or_garbled_files_are_named(tmp_path: Path) -> None:
    adapter = _adapter(0)
    save_checkpoint(tmp_path, adapter, _optimizer(adapter), _state(3))
    opt = tmp_path / OPTIMIZER_FILE
    opt.write_bytes(opt.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"{OPTIMIZER_FILE}: size: .* bytes"):
        load_checkpoint(tmp_path)
    opt.unlink()
    with pytest.raises(CheckpointError, match=rf"{OPTIMIZER_FILE}: missing"):
        load_checkpoint(tmp_path)
    (tmp_path / STATE_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"{STATE_FILE}: json"):
        load_checkpoint(tmp_path)
    (tmp_path / STATE_FILE).unlink()
    with pytest.raises(CheckpointError, match=rf"{STATE_FILE}: missing: incomplete"):
        load_checkpoint(tmp_path)


def test_latest_checkpoint_skips_incomplete_and_corrupt(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "nothing-here") is None
    assert latest_checkpoint(tmp_path) is None
    adapter = _adapter(0)
    for step in (5, 10, 15, 20):
        save_checkpoint(checkpoint_dir(tmp_path, step), adapter, _optimizer(adapter), _state(step))
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 20)

    (checkpoint_dir(tmp_path, 20) / STATE_FILE).unlink()  # crashed before the JSON: incomplete
    bad = checkpoint_dir(tmp_path, 15) / ADAPTER_FILE  # hash no longer matches
    bad.write_bytes(bad.read_bytes()[:-1] + b"\x00")
    (tmp_path / "notes").mkdir()  # unrelated folder
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 10)


def test_save_rejects_what_it_cannot_restore(tmp_path: Path) -> None:
    adapter = _adapter(0)
    with pytest.raises(CheckpointError, match=r"state\.cursor\.row: int64 is not plain JSON"):
        save_checkpoint(tmp_path, adapter, {}, {**_state(1), "cursor": {"row": np.int64(3)}})
    with pytest.raises(CheckpointError, match=r"state\.step: None"):
        save_checkpoint(tmp_path, adapter, {}, {"epoch": 0})
    f64 = {k: R.LoraPair(A=p.A.astype(np.float64), B=p.B) for k, p in adapter.items()}
    with pytest.raises(CheckpointError, match=rf"{ADAPTER_FILE}: pair \(0, 'q'\): A: dtype float64"):
        save_checkpoint(tmp_path, f64, {}, _state(1))
    assert not (tmp_path / STATE_FILE).exists()  # nothing half-written
