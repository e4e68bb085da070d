"""Hostile GGUF files: truncated, patched counts/lengths/offsets, bad types, random bytes and mutations.

Every case must raise GGUFError naming the file and the offending field, quickly and without allocating much
(tracemalloc peak < 64 MiB), never another exception. Patched SmolLM2 copies hold only the real header bytes;
the rest of each file is a sparse hole of the right length (the reader never reads tensor data at open).
"""

from __future__ import annotations

import re
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from model.gguf import GGUFError, GGUFFile, write_gguf

PEAK_LIMIT = 64 << 20
TIME_LIMIT_S = 5.0


def assert_rejected(path: Path, *fields: str, trace: bool = True) -> str:
    """Opening `path` must raise GGUFError naming the file and each of `fields`, fast and (with `trace`,
    measured by tracemalloc, which slows a full SmolLM2 header parse from 0.05 s to 1 s) allocating little."""
    if trace:
        tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(GGUFError) as exc_info:
            GGUFFile(path).close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    elapsed = time.perf_counter() - t0
    msg = str(exc_info.value)
    assert msg.startswith(f"{path}: "), msg
    for field in fields:
        assert re.search(field, msg), (field, msg)
    assert peak < PEAK_LIMIT, f"{peak / 2**20:.1f} MiB peak for {msg}"
    assert elapsed < TIME_LIMIT_S, f"{elapsed:.1f} s for {msg}"
    return msg


# --- SmolLM2-based files ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_header(smollm2_path: Path) -> tuple[bytes, int]:
    """(header bytes up to the tensor data, full file size) of the real file."""
    with GGUFFile(smollm2_path) as f:
        data_offset, size = f.data_offset, f.file_size
    with open(smollm2_path, "rb") as fh:
        return fh.read(data_offset), size


def sparse_copy(dst: Path, header: bytes, length: int, patches: dict[int, bytes] | None = None) -> Path:
    """A file of `length` bytes: the (patched) header prefix, then a hole."""
    buf = bytearray(header[:length])
    for pos, value in (patches or {}).items():
        buf[pos : pos + len(value)] = value
    with open(dst, "wb") as fh:
        fh.write(buf)
        fh.truncate(length)
    return dst


def tensor_info_pos(header: bytes, name: str) -> int:
    """Offset just past tensor `name`'s name in the tensor infos (found by its length-prefixed name)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = header.index(key)
    assert header.find(key, pos + 1) == -1
    return pos + len(key)


def kv_pos(header: bytes, key: str) -> int:
    """Offset just past the key string `key` (at its value type)."""
    needle = struct.pack("<Q", len(key)) + key.encode()
    return header.index(needle) + len(needle)


@pytest.mark.parametrize("k", range(1, 16))
def test_truncated_at_sixteenths(smol_header, tmp_path: Path, k: int) -> None:
    header, size = smol_header
    path = sparse_copy(tmp_path / f"cut{k}.gguf", header, size * k // 16)
    assert_rejected(path, "tensor '[^']+'", "offset", "beyond the end of the file", trace=k in (1, 15))


@pytest.mark.parametrize("k", range(1, 16))
def test_truncated_inside_header(smol_header, tmp_path: Path, k: int) -> None:
    header, _ = smol_header
    path = sparse_copy(tmp_path / f"hcut{k}.gguf", header, len(header) * k // 16)
    assert_rejected(path, "(key|tensor) ", "remain", trace=k in (1, 8, 15))


def second_token_pos(header: bytes) -> int:
    """Offset of the length of tokenizer.ggml.tokens[1]."""
    first = kv_pos(header, "tokenizer.ggml.tokens") + 4 + 4 + 8
    return first + 8 + struct.unpack_from("<Q", header, first)[0]


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def _u32(v: int) -> bytes:
    return struct.pack("<I", v)


SMOL_PATCHES: dict[str, tuple[Callable[[bytes], dict[int, bytes]], tuple[str, ...]]] = {
    "tensor_count_2p60": (lambda h: {8: _u64(2**60)}, ("header", "tensor_count")),
    "kv_count_2p60": (lambda h: {16: _u64(2**60)}, ("header", "kv_count")),
    "tensor_count_plus_one": (lambda h: {8: _u64(273)}, ("tensor ''", "n_dims")),  # reads padding + hole
    "first_key_length": (lambda h: {24: _u64(2**62)}, ("key #0", "key", "remain")),
    "tokens_count_2p60": (
        lambda h: {kv_pos(h, "tokenizer.ggml.tokens") + 8: _u64(2**60)},
        ("tokenizer.ggml.tokens", "array of 1152921504606846976 strings"),
    ),
    "merges_count_2p60": (
        lambda h: {kv_pos(h, "tokenizer.ggml.merges") + 8: _u64(2**60)},
        ("tokenizer.ggml.merges", "strings"),
    ),
    "token_string_length": (
        lambda h: {second_token_pos(h): _u64(2**63)},
        (r"tokenizer\.ggml\.tokens'\[1\]", "string"),
    ),
    "token_type_count": (
        lambda h: {kv_pos(h, "tokenizer.ggml.token_type") + 8: _u64(2**61)},
        ("token_type", "INT32"),
    ),
    "value_type_unknown": (
        lambda h: {kv_pos(h, "llama.block_count"): _u32(13)},
        ("llama.block_count", "value type", "unknown GGUF value type 13"),
    ),
    "array_element_type_unknown": (
        lambda h: {kv_pos(h, "tokenizer.ggml.token_type") + 4: _u32(77)},
        ("token_type", "array element type", "77"),
    ),
    "offset_out_of_range": (
        lambda h: {tensor_info_pos(h, "blk.29.ffn_down.weight") + 4 + 16 + 4: _u64(2**40)},
        ("blk.29.ffn_down.weight", "offset", "beyond the end"),
    ),
    "offset_misaligned": (
        lambda h: {tensor_info_pos(h, "token_embd.weight") + 4 + 16 + 4: _u64(8)},
        ("token_embd.weight", "offset", "general.alignment=32"),
    ),
    "offset_overlap": (
        lambda h: {tensor_info_pos(h, "output_norm.weight") + 4 + 8 + 4: _u64(64)},
        ("output_norm.weight", "overlaps tensor 'token_embd.weight'"),
    ),
    "ggml_type_unknown": (
        lambda h: {tensor_info_pos(h, "blk.3.attn_q.weight") + 4 + 16: _u32(99)},
        ("blk.3.attn_q.weight", "type", "unknown ggml type id 99"),
    ),
    "ggml_type_removed": (
        lambda h: {tensor_info_pos(h, "blk.3.attn_q.weight") + 4 + 16: _u32(4)},
        ("blk.3.attn_q.weight", "unknown ggml type id 4"),
    ),
    "n_dims_5": (lambda h: {tensor_info_pos(h, "blk.0.attn_k.weight"): _u32(5)}, ("attn_k", "n_dims", "5")),
    "n_dims_0": (lambda h: {tensor_info_pos(h, "blk.0.attn_k.weight"): _u32(0)}, ("attn_k", "n_dims", "0")),
    "ne_zero": (lambda h: {tensor_info_pos(h, "blk.0.attn_k.weight") + 12: _u64(0)}, ("attn_k", r"ne\[1\]")),
    "ne_huge": (
        lambda h: {tensor_info_pos(h, "blk.0.attn_k.weight") + 12: _u64(2**62)},
        ("attn_k", "offset", "beyond the end"),
    ),
    "ne0_not_block_multiple": (
        lambda h: {tensor_info_pos(h, "blk.0.attn_k.weight") + 4: _u64(570)},
        ("attn_k", r"ne\[0\]", "Q4_1 block size 32"),
    ),
    "duplicate_tensor": (
        lambda h: {tensor_info_pos(h, "blk.0.attn_k.weight") - 8: b"q"},
        ("blk.0.attn_q.weight", "duplicate tensor name"),
    ),
    "duplicate_key": (
        lambda h: {kv_pos(h, "general.basename") - 8: b"finetune"},
        ("general.finetune", "duplicate key"),
    ),
    "invalid_utf8_key": (lambda h: {kv_pos(h, "general.name") - 1: b"\xff"}, ("key #", "UTF-8")),
    "invalid_utf8_token": (
        lambda h: {kv_pos(h, "tokenizer.ggml.tokens") + 16 + 8: b"\xc3"},
        (r"tokens'\[0\]", "UTF-8"),
    ),
    "bad_magic": (lambda h: {0: b"GGUG"}, ("header", "magic")),
    "version_1": (lambda h: {4: _u32(1)}, ("header", "version", "1 not in")),
    "big_endian": (lambda h: {4: struct.pack(">I", 3)}, ("version", "big-endian")),
}


# Cases that could allocate from a patched count or length (the others fail after the same full-header parse).
TRACED = {
    "tensor_count_2p60",
    "kv_count_2p60",
    "tensor_count_plus_one",
    "first_key_length",
    "tokens_count_2p60",
    "merges_count_2p60",
    "token_string_length",
    "token_type_count",
    "ne_huge",
    "n_dims_5",
}


@pytest.mark.parametrize("case", list(SMOL_PATCHES))
def test_patched_smollm2(smol_header, tmp_path: Path, case: str) -> None:
    header, size = smol_header
    make_patches, fields = SMOL_PATCHES[case]
    path = sparse_copy(tmp_path / f"{case}.gguf", header, size, make_patches(header))
    assert_rejected(path, *fields, trace=case in TRACED)


def test_unpatched_sparse_copy_opens(smol_header, tmp_path: Path) -> None:
    """Control: the sparse copy itself is a valid file, so the failures above come from the patches."""
    header, size = smol_header
    with GGUFFile(sparse_copy(tmp_path / "ok.gguf", header, size)) as f:
        assert len(f.tensors) == 272 and len(f.metadata["tokenizer.ggml.tokens"]) == 49152


# --- small synthetic files ----------------------------------------------------------------------------------


@pytest.fixture()
def small(tmp_path: Path) -> bytes:
    """A small valid file: a few keys of each kind and three tensors, general.alignment = 64."""
    path = tmp_path / "small.gguf"
    md = {
        "general.alignment": 64,
        "aa.x": 5,
        "ab.x": 6,
        "t.list": ["x", "yz"],
        "t.arr": np.arange(4, dtype=np.int32),
    }
    rng = np.random.default_rng(0)
    tensors = [
        ("aa", rng.standard_normal((2, 32)).astype(np.float32), Q.F32),
        ("ab", rng.integers(0, 256, (2, 34), dtype=np.uint8), Q.Q8_0),
        ("norm", np.ones(8, np.float32), Q.F16),
    ]
    write_gguf(path, "llama", md, tensors)
    return path.read_bytes()


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_small_file_is_valid(small: bytes, tmp_path: Path) -> None:
    with GGUFFile(_write(tmp_path / "s.gguf", small)) as f:
        assert f.alignment == 64 and list(f.tensors) == ["aa", "ab", "norm"]


@pytest.mark.parametrize(
    ("value", "match"),
    [(48, "48 is not a power of two"), (0, "0 is not a power of two"), (2**31 + 1, "not a power of two")],
)
def test_bad_alignment(small: bytes, tmp_path: Path, value: int, match: str) -> None:
    buf = bytearray(small)
    pos = kv_pos(small, "general.alignment")
    assert struct.unpack_from("<I", buf, pos) == (V.UINT32,)
    buf[pos + 4 : pos + 8] = _u32(value)
    assert_rejected(_write(tmp_path / "align.gguf", bytes(buf)), "general.alignment", match)


def test_alignment_of_wrong_type(small: bytes, tmp_path: Path) -> None:
    buf = bytearray(small)
    buf[kv_pos(small, "general.alignment") : kv_pos(small, "general.alignment") + 4] = _u32(V.FLOAT32)
    assert_rejected(_write(tmp_path / "align.gguf", bytes(buf)), "general.alignment", "not an integer type")


def test_small_duplicates_and_bad_row(small: bytes, tmp_path: Path) -> None:
    dup_key = small.replace(struct.pack("<Q", 4) + b"ab.x", struct.pack("<Q", 4) + b"aa.x")
    assert_rejected(_write(tmp_path / "k.gguf", dup_key), "'aa.x'", "duplicate key")
    dup_tensor = small.replace(struct.pack("<Q", 2) + b"ab", struct.pack("<Q", 2) + b"aa")
    assert_rejected(_write(tmp_path / "t.gguf", dup_tensor), "tensor 'aa'", "duplicate tensor name")
    buf = bytearray(small)
    pos = tensor_info_pos(small, "ab")
    buf[pos + 4 : pos + 12] = _u64(33)  # Q8_0 row of 33 elements
    assert_rejected(_write(tmp_path / "r.gguf", bytes(buf)), "tensor 'ab'", r"ne\[0\]", "Q8_0")


def _file(kvs: bytes, n_kv: int = 1, n_tensors: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + _u32(version) + _u64(n_tensors) + _u64(n_kv) + kvs


def _key(name: str) -> bytes:
    return _u64(len(name)) + name.encode()


def test_nested_arrays(tmp_path: Path) -> None:
    depth = 10
    nested = _key("deep") + _u32(V.ARRAY) + (_u32(V.ARRAY) + _u64(1)) * depth + _u32(V.UINT8) + _u64(1) + b"\x01"
    assert_rejected(_write(tmp_path / "deep.gguf", _file(nested + b"\0" * 64)), "'deep'", "nested deeper")
    wide = _key("wide") + _u32(V.ARRAY) + _u32(V.ARRAY) + _u64(2**59) + b"\0" * 64
    assert_rejected(_write(tmp_path / "wide.gguf", _file(wide)), "'wide'", "array of 576460752303423488 arrays")
    ok = _key("ok") + _u32(V.ARRAY) + _u32(V.ARRAY) + _u64(2) + (_u32(V.INT16) + _u64(2) + b"\1\0\2\0") * 2
    with GGUFFile(_write(tmp_path / "ok.gguf", _file(ok))) as f:
        assert [a.tolist() for a in f.metadata["ok"]] == [[1, 2], [1, 2]]


@pytest.mark.parametrize("size", [0, 1, 23, 24, 100, 4096])
def test_random_bytes(tmp_path: Path, size: int) -> None:
    rng = np.random.default_rng(size)
    body = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    assert_rejected(_write(tmp_path / "rand.gguf", body))
    if size >= 24:  # with a valid magic and version the counts/keys must be rejected instead
        assert_rejected(_write(tmp_path / "rand3.gguf", b"GGUF" + _u32(3) + body[8:]))


def test_mutation_fuzz(small: bytes, tmp_path: Path) -> None:
    """Random byte edits of a valid file: each opens (every raw view in bounds) or raises GGUFError."""
    rng = np.random.default_rng(1234)
    path = tmp_path / "fuzz.gguf"
    opened = rejected = 0
    for _ in range(400):
        buf = bytearray(small)
        for pos in rng.integers(0, len(buf), int(rng.integers(1, 4))):
            buf[pos] = int(rng.integers(0, 256))
        if rng.random() < 0.2:
            del buf[int(rng.integers(24, len(buf))) :]
        path.write_bytes(bytes(buf))
        try:
            f = GGUFFile(path)
        except GGUFError as exc:
            assert str(exc).startswith(f"{path}: ")
            rejected += 1
            continue
        with f:
            for info, raw in f.iter_tensors():
                assert raw.nbytes == info.nbytes and info.offset + info.nbytes <= len(buf)
            opened += 1
    assert opened > 0 and rejected > 0
