"""GGUF reader/writer: round trips of every ggml type, SmolLM2 against gguf.GGUFReader, LoRA files."""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFValueType
from gguf import GGMLQuantizationType as Q

from model import quant
from model.config import ModelConfig
from model.gguf import GGUFError, GGUFFile, describe, model_config, write_gguf, write_lora_gguf

# Tolerance of decode(encode(x)) relative to max|x| for the types our writer encodes from floats.
ENCODE_TOL = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.Q8_0: 1e-2,
    Q.Q6_K: 3e-2,
    Q.Q5_0: 7e-2,
    Q.Q5_1: 5e-2,
    Q.Q4_0: 0.15,
    Q.Q4_1: 0.1,
    Q.Q4_K: 0.1,
}


@pytest.fixture(scope="module")
def reader(smollm2_path: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(str(smollm2_path))


@pytest.fixture(scope="module")
def smol(smollm2_path: Path):
    with GGUFFile(smollm2_path) as f:
        yield f


# --- round trips --------------------------------------------------------------------------------------------


def _values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def test_round_trip_every_type(tmp_path: Path) -> None:
    """Every ggml type: encoded from floats or given as raw rows; bytes and values come back."""
    rng = np.random.default_rng(0)
    rows, row_len = 3, 512  # 512: a whole number of blocks for every type (block sizes 1..256)
    tensors, expect_f32, expect_bytes = [], {}, {}
    for qtype in (Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q6_K):  # encoded by write_gguf
        x = _values(rng, (rows, row_len))
        tensors.append((f"enc.{qtype.name}", x, int(qtype)))
        expect_f32[f"enc.{qtype.name}"] = (x, ENCODE_TOL[qtype])
    for qtype in (Q.BF16, Q.Q5_1):  # float data encoded by gguf-py's reference encoder, passed as raw rows
        x = _values(rng, (rows, row_len))
        enc = gguf.quants.quantize(x, qtype)
        tensors.append((f"pre.{qtype.name}", enc, int(qtype)))
        expect_bytes[f"pre.{qtype.name}"] = enc
    for qtype in GGML_QUANT_SIZES:  # every type: random block bytes, a pure container round trip
        block, size = GGML_QUANT_SIZES[qtype]
        enc = rng.integers(0, 256, (rows, row_len // block * size), dtype=np.uint8)
        tensors.append((f"raw.{qtype.name}", enc, int(qtype)))
        expect_bytes[f"raw.{qtype.name}"] = enc
    vec, cube = _values(rng, (40,)), _values(rng, (2, 3, 32))
    tensors += [("vec", vec, Q.F32), ("cube", cube, Q.F32)]
    path = tmp_path / "all.gguf"
    write_gguf(path, "llama", {"general.name": "all types"}, iter(tensors))

    with GGUFFile(path) as f:
        assert list(f.tensors) == [t[0] for t in tensors]
        assert f.version == 3 and f.alignment == 32
        for name, data, qtype in tensors:
            info = f.tensors[name]
            block, size = GGML_QUANT_SIZES[Q(qtype)]
            logical = data.shape if data.dtype != np.uint8 else (*data.shape[:-1], data.shape[-1] // size * block)
            assert info.ggml_type == qtype and info.shape == logical and info.ne == logical[::-1], name
            assert info.nbytes == math.prod(logical) // block * size and info.offset % 32 == 0, name
            assert f.raw(name).shape == (math.prod(logical[:-1]), logical[-1] // block * size), name
        for name, enc in expect_bytes.items():
            assert np.array_equal(f.raw(name), enc.reshape(f.raw(name).shape)), name
        for name, (x, tol) in expect_f32.items():
            got = f.tensor_f32(name)
            info = f.tensors[name]
            reference = gguf.quants.dequantize(f.raw(name), Q(info.ggml_type)).reshape(info.shape)
            assert got.dtype == np.float32 and np.array_equal(got, reference), name  # our decode = gguf-py's
            assert np.abs(got - x).max() <= tol * np.abs(x).max(), name  # and it is a decode of x
        assert np.array_equal(f.tensor_f32("vec"), vec) and np.array_equal(f.tensor_f32("cube"), cube)
        for name in expect_bytes:
            if f.tensors[name].ggml_type not in quant.SUPPORTED_TYPES:
                with pytest.raises(GGUFError, match=f"{re.escape(str(path))}: tensor '{name}': type"):
                    f.tensor_f32(name)
                break
    other = gguf.GGUFReader(str(path))  # an independent reader agrees on every tensor
    assert [t.name for t in other.tensors] == [t[0] for t in tensors]
    with GGUFFile(path) as f:
        for t in other.tensors:
            info = f.tensors[t.name]
            assert (int(t.tensor_type), tuple(int(n) for n in t.shape)) == (info.ggml_type, info.ne)
            assert np.array_equal(f.raw(t.name).reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))


def test_metadata_round_trip_keeps_values_and_types(tmp_path: Path) -> None:
    V = GGUFValueType
    md = {
        "general.name": "tëst ✓",
        "general.empty": "",
        "t.bool": True,
        "t.u32": 30,
        "t.neg": -5,
        "t.big": 2**40,
        "t.f32": 1e-5,
        "t.u8": np.uint8(7),
        "t.i16": np.int16(-300),
        "t.u64": np.uint64(2**63 + 1),
        "t.f64": np.float64(0.1),
        "t.hinted": 3,
        "t.strings": ["a", "", "Ġ t", "日本"],
        "t.ints": [1, -2, 3],
        "t.floats": [0.5, 1.5],
        "t.i32arr": np.array([3, 1, 2], dtype=np.int32),
        "t.u8arr": np.arange(5, dtype=np.uint8),
        "t.f64arr": np.array([1e300, -2.0]),
        "t.bools": np.array([True, False, True]),
    }
    want = {
        "general.architecture": V.STRING,
        "general.name": V.STRING,
        "general.empty": V.STRING,
        "t.bool": V.BOOL,
        "t.u32": V.UINT32,
        "t.neg": V.INT32,
        "t.big": V.UINT64,
        "t.f32": V.FLOAT32,
        "t.u8": V.UINT8,
        "t.i16": V.INT16,
        "t.u64": V.UINT64,
        "t.f64": V.FLOAT64,
        "t.hinted": V.INT64,
    }
    path = tmp_path / "md.gguf"
    write_gguf(path, "llama", md, [("w", np.ones((2, 32), np.float32), Q.F32)], metadata_types={"t.hinted": V.INT64})
    with GGUFFile(path) as f:
        assert list(f.metadata) == ["general.architecture", *md]
        for key, vtype in want.items():
            assert f.metadata_types[key] == vtype, key
        assert f.metadata["t.f32"] == np.float32(1e-5) and f.metadata["t.u64"] == 2**63 + 1
        assert f.metadata["t.strings"] == md["t.strings"] and f.metadata["general.name"] == md["general.name"]
        assert f.metadata["t.ints"].dtype == np.int32 and f.metadata["t.floats"].dtype == np.float32
        for key in ("t.ints", "t.floats", "t.i32arr", "t.u8arr", "t.f64arr", "t.bools"):
            assert f.metadata_types[key] == V.ARRAY
            assert np.array_equal(f.metadata[key], np.asarray(md[key])), key
        assert f.metadata["t.u8arr"].dtype == np.uint8 and f.metadata["t.bools"].dtype == bool
        for key in (
            "t.bool",
            "t.u32",
            "t.neg",
            "t.big",
            "t.u8",
            "t.i16",
            "t.f64",
            "t.hinted",
            "general.empty",
        ):
            assert f.metadata[key] == md[key] and type(f.metadata[key]) is type(np.asarray(md[key]).item()), key
        rewritten = tmp_path / "md2.gguf"
        write_gguf(rewritten, "llama", f.metadata, [("w", f.raw("w"), Q.F32)], metadata_types=f.metadata_types)
    assert rewritten.read_bytes() == path.read_bytes()


def test_write_is_atomic_and_validates(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", {}, [("a", np.zeros((2, 32), np.float32), Q.F32)])
    before = path.read_bytes()

    def failing():
        yield "a", np.ones((2, 32), np.float32), Q.F32
        raise RuntimeError("producer died")

    with pytest.raises(RuntimeError, match="producer died"):
        write_gguf(path, "llama", {}, failing())
    bad = [
        ([("a", np.zeros((2, 32), np.float32), Q.F32), ("a", np.zeros(4, np.float32), Q.F32)], "'a': name"),
        ([("b", np.zeros((2, 35), np.uint8), Q.Q8_0)], "'b': row bytes"),
        ([("c", np.zeros((2, 30), np.float32), Q.Q8_0)], "'c': shape"),
        ([("d", np.zeros((2, 32), np.float32), 99)], "'d': type: unknown ggml type id 99"),
        ([("e", np.zeros((2, 256), np.float32), Q.IQ2_XXS)], "'e': type"),  # no encoder for it
        ([("f", np.zeros((1, 1, 1, 1, 4), np.float32), Q.F32)], "'f': shape"),
    ]
    for tensors, match in bad:
        with pytest.raises(GGUFError, match=f"{re.escape(str(path))}: tensor {match}"):
            write_gguf(path, "llama", {}, tensors)
    for md, match in [
        ({"general.architecture": "gemma3"}, "general.architecture"),
        ({"x": []}, "'x': value"),
        ({"x": np.zeros((2, 2))}, "'x': value"),
        ({"x": object()}, "'x': value"),
        ({"general.alignment": 48}, "general.alignment"),
    ]:
        with pytest.raises(GGUFError, match=match):
            write_gguf(path, "llama", md, [])
    with pytest.raises(GGUFError, match="'x': value"):
        write_gguf(path, "llama", {"x": 300}, [], metadata_types={"x": GGUFValueType.UINT8})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temp files left behind


def test_custom_alignment_is_written_and_honoured(tmp_path: Path) -> None:
    path = tmp_path / "a.gguf"
    write_gguf(
        path,
        "llama",
        {"general.alignment": 64},
        [("a", np.ones(3, np.float32), Q.F32), ("b", np.ones((2, 32), np.float32), Q.F16)],
    )
    with GGUFFile(path) as f:
        assert f.alignment == 64 and all(t.offset % 64 == 0 for t in f.tensors.values())
        assert np.array_equal(f.tensor_f32("b"), np.ones((2, 32), np.float32))


# --- the real SmolLM2 file ----------------------------------------------------------------------------------


def test_smollm2_config(smol: GGUFFile) -> None:
    assert smol.config() == ModelConfig(
        n_layers=30,
        hidden=576,
        ffn=1536,
        n_heads=9,
        n_kv_heads=3,
        vocab=49152,
        head_dim=64,
        rope_base=1e5,
        eps=1e-5,
        context_length=8192,
        tied_embeddings=True,
        arch="llama",
    )


def test_smollm2_tensor_counts(smol: GGUFFile) -> None:
    counts = Counter(Q(t.ggml_type).name for t in smol.tensors.values())
    assert counts == {"Q4_1": 210, "F32": 61, "Q8_0": 1} and len(smol.tensors) == 272
    assert smol.tensors["token_embd.weight"].ggml_type == Q.Q8_0 and "output.weight" not in smol.tensors


def test_smollm2_metadata_matches_gguf_reader(smol: GGUFFile, reader: gguf.GGUFReader) -> None:
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(smol.metadata) == keys
    for key in keys:
        field = reader.fields[key]
        ours = smol.metadata[key]
        assert smol.metadata_types[key] == field.types[0], key
        if field.types[0] == GGUFValueType.ARRAY and field.types[-1] != GGUFValueType.STRING:
            assert isinstance(ours, np.ndarray) and ours.tolist() == list(field.contents()), key
        else:
            assert ours == field.contents(), key
    assert len(smol.metadata["tokenizer.ggml.tokens"]) == 49152 and len(smol.metadata["tokenizer.ggml.merges"]) == 48900


def test_smollm2_tensors_match_gguf_reader(smol: GGUFFile, reader: gguf.GGUFReader) -> None:
    assert list(smol.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = smol.tensors[t.name]
        assert info.ggml_type == int(t.tensor_type) and info.ne == tuple(int(n) for n in t.shape), t.name
        assert info.shape == tuple(reversed(info.ne)) and (info.offset, info.nbytes) == (
            t.data_offset,
            t.n_bytes,
        )
        raw = smol.raw(t.name)
        assert raw.dtype == np.uint8 and raw.shape == (math.prod(info.shape[:-1]), info.row_bytes), t.name
        assert np.array_equal(raw.reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8)), t.name


def test_smollm2_raw_is_a_view_and_iterates_in_order(smol: GGUFFile) -> None:
    seen = []
    for info, raw in smol.iter_tensors():
        assert not raw.flags.owndata and not raw.flags.writeable
        seen.append(info.name)
    assert seen == list(smol.tensors)
    w = smol.tensor_f32("blk.0.attn_q.weight")
    expect = gguf.quants.dequantize(smol.raw("blk.0.attn_q.weight"), Q.Q4_1)
    assert w.shape == (576, 576) and np.array_equal(w, expect)


def test_smollm2_vocab_parses_fast(smollm2_path: Path) -> None:
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        GGUFFile(smollm2_path).close()
        best = min(best, time.perf_counter() - t0)
    assert best < 1.0, f"header parse took {best:.2f} s"


def test_smollm2_rewrite_is_byte_identical(smol: GGUFFile, smollm2_path: Path, tmp_path: Path) -> None:
    """Metadata (with its types) + raw tensors through write_gguf reproduce the original file exactly."""
    out = tmp_path / "copy.gguf"
    tensors = ((i.name, raw.reshape(*i.shape[:-1], -1), i.ggml_type) for i, raw in smol.iter_tensors())
    write_gguf(out, smol.metadata["general.architecture"], smol.metadata, tensors, metadata_types=smol.metadata_types)
    assert out.stat().st_size == smollm2_path.stat().st_size
    with open(out, "rb") as a, open(smollm2_path, "rb") as b:
        while chunk := a.read(1 << 24):
            assert chunk == b.read(1 << 24)
    out.unlink()  # 98 MB


def test_describe(smollm2_path: Path, reader: gguf.GGUFReader) -> None:
    d = describe(smollm2_path)
    assert d["architecture"] == "llama" and d["tokenizer"] == "gpt2" and d["vocab_size"] == 49152
    assert d["chat_template"] is True and d["tensors"] == 272
    assert d["tensors_by_type"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    assert d["parameters"] == sum(int(t.n_elements) for t in reader.tensors)
    assert d["tensor_bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert d["config"]["n_layers"] == 30 and d["config"]["tied_embeddings"] is True


def test_describe_other_architecture(tmp_path: Path) -> None:
    path = tmp_path / "g.gguf"
    write_gguf(path, "gemma2", {"gemma2.block_count": 2}, [("w", np.ones((4, 32), np.float32), Q.F16)])
    d = describe(path)
    assert d["architecture"] == "gemma2" and d["config"] is None and "supported: llama" in d["config_error"]
    assert (d["parameters"], d["tensor_bytes"], d["tensors_by_type"]) == (128, 256, {"F16": 1})
    assert d["vocab_size"] is None and d["chat_template"] is False


# --- model_config -------------------------------------------------------------------------------------------


def _llama_md(**extra) -> dict:
    md = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": np.float32(1e4).item(),
        "llama.attention.layer_norm_rms_epsilon": 1e-6,
        "llama.context_length": 256,
        "llama.vocab_size": 300,
    }
    md.update(extra)
    return {k: v for k, v in md.items() if v is not None}


def test_model_config_variants() -> None:
    cfg = model_config(_llama_md())
    assert (cfg.n_layers, cfg.hidden, cfg.ffn, cfg.n_heads, cfg.n_kv_heads) == (2, 64, 128, 4, 2)
    assert (cfg.head_dim, cfg.vocab, cfg.eps, cfg.tied_embeddings) == (16, 300, 1e-6, True)
    assert not model_config(_llama_md(), has_output=True).tied_embeddings
    assert model_config(_llama_md(**{"llama.attention.key_length": 32})).head_dim == 32
    tokens = ["t"] * 123
    assert model_config(_llama_md(**{"llama.vocab_size": None, "tokenizer.ggml.tokens": tokens})).vocab == 123


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"general.architecture": "gemma2"}, "'gemma2' is not supported: .*soft-capping.*\\(supported: llama, qwen2"),
        ({"general.architecture": "phi3"}, "'phi3' is not supported \\(supported: llama, qwen2, qwen3, gemma3\\)"),
        ({"llama.rope.scaling.type": "yarn"}, "src.gguf: key 'llama.rope.scaling.type': value: rope scaling 'yarn'"),
        ({"llama.attention.value_length": 8}, "src.gguf: key 'llama.attention.value_length': value: 8 != key_length"),
        ({"general.architecture": None}, "general.architecture'.*missing"),
        ({"llama.block_count": None}, "src.gguf: key 'llama.block_count': value: missing"),
        ({"llama.attention.layer_norm_rms_epsilon": None}, "layer_norm_rms_epsilon'.*missing"),
        ({"llama.vocab_size": None}, "vocab_size'.*missing"),
        ({"llama.embedding_length": "576"}, "embedding_length'.*not a scalar int"),
        ({"llama.feed_forward_length": np.array([128, 128])}, "feed_forward_length'.*not a scalar int"),
        ({"llama.block_count": 0}, "block_count'.*positive"),
        ({"llama.attention.head_count_kv": 3}, "head_count_kv"),
        ({"llama.rope.dimension_count": 8}, "partial rotary"),
    ],
)
def test_model_config_errors(change: dict, match: str) -> None:
    with pytest.raises(GGUFError, match=match):
        model_config(_llama_md(**change), source="src.gguf")


# --- LoRA ---------------------------------------------------------------------------------------------------


def test_lora_gguf_round_trip(smol: GGUFFile, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    r, cfg = 4, smol.config()
    tensors = {}
    for layer in (0, 29):
        for stem, target in (("attn_q", "q"), ("attn_k", "k"), ("ffn_down", "down")):
            out_f, in_f = cfg.target_shape(target)
            tensors[f"blk.{layer}.{stem}.weight.lora_a"] = rng.standard_normal((r, in_f))
            tensors[f"blk.{layer}.{stem}.weight.lora_b"] = rng.standard_normal((out_f, r)).astype(np.float32)
    path = tmp_path / "adapter.gguf"
    write_lora_gguf(path, smol.metadata, alpha=8.0, tensors=tensors)
    with GGUFFile(path) as f:
        assert f.metadata["general.architecture"] == "llama" and f.metadata["general.type"] == "adapter"
        assert f.metadata["adapter.type"] == "lora" and f.metadata["adapter.lora.alpha"] == 8.0
        assert f.metadata_types["adapter.lora.alpha"] == GGUFValueType.FLOAT32
        assert list(f.tensors) == list(tensors)
        for name, t in tensors.items():
            info = f.tensors[name]
            assert info.ggml_type == Q.F32 and info.shape == t.shape and info.ne == t.shape[::-1]
            assert np.array_equal(f.tensor_f32(name), t.astype(np.float32))
        # ne as llama.cpp expects: lora_a [in, r], lora_b [r, out]
        assert f.tensors["blk.0.attn_k.weight.lora_a"].ne == (576, r)
        assert f.tensors["blk.0.attn_k.weight.lora_b"].ne == (r, 192)
    d = describe(path)
    assert d["type"] == "adapter" and d["lora_alpha"] == 8.0 and d["lora_targets"] == ["down", "k", "q"]
    write_lora_gguf(tmp_path / "by_arch.gguf", "llama", 16.0, tensors)  # arch only: no shape check
    with GGUFFile(tmp_path / "by_arch.gguf") as f:
        assert f.metadata["adapter.lora.alpha"] == 16.0 and len(f.tensors) == len(tensors)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t.pop("blk.0.attn_q.weight.lora_b"), "has no partner"),
        (lambda t: t.update({"blk.0.attn_q.weight.lora_a": np.zeros((3, 576))}), "rank 3 != rank 4"),
        (lambda t: t.update({"blk.0.attn_q.weight.lora_a": np.zeros((4, 100))}), "do not fit the base"),
        (lambda t: t.update({"blk.0.attn_q.weight.lora_a": np.zeros(4)}), "not 2-D"),
        (
            lambda t: t.update(
                {
                    "blk.30.attn_q.weight.lora_a": t["blk.0.attn_q.weight.lora_a"],
                    "blk.30.attn_q.weight.lora_b": t["blk.0.attn_q.weight.lora_b"],
                }
            ),
            "block_count 30",
        ),
        (lambda t: t.update({"attn_q.lora_a": np.zeros((4, 576))}), "expected blk.N"),
    ],
)
def test_lora_gguf_rejects_bad_adapters(smol: GGUFFile, tmp_path: Path, edit, match: str) -> None:
    tensors = {
        "blk.0.attn_q.weight.lora_a": np.zeros((4, 576)),
        "blk.0.attn_q.weight.lora_b": np.zeros((576, 4)),
    }
    edit(tensors)
    path = tmp_path / "bad.gguf"
    with pytest.raises(GGUFError, match=match):
        write_lora_gguf(path, smol.metadata, 1.0, tensors)
    assert not path.exists()
