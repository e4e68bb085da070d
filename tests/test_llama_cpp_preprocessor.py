"""bench/llama_cpp_gemm.py's preprocessor for llama.cpp's WGSL directives (their files are not in the repository:
these inputs are written here). Checked against their pre_wgsl.hpp by hand-derived expected outputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.llama_cpp_gemm import LlamaTile, PreprocessError, evaluate, preprocess, their_grid  # noqa: E402


def test_defines_conditions_and_expansion(tmp_path: Path) -> None:
    (tmp_path / "decls.tmpl").write_text("#ifdef VEC\n#define TYPE vec4<ELEM>\n#else\n#define TYPE ELEM\n#endif\n")
    src = (
        '#include "decls.tmpl"\n'
        "#define TILE 8u\n"  # predefined below: the shader's own #define loses
        "#define WIDE TILE * 2u\n"
        "var<storage> a: array<TYPE>;\n"
        "const N = WIDE; // TILE_2 stays\n"
        "#if defined(VEC) && TILE_K / 16 == 2\n"
        "const K2 = 1;\n"
        "#elif defined(VEC)\n"
        "const K2 = 0;\n"
        "#else\n"
        "const NOVEC = 1;\n"
        "#endif\n"
        "#ifndef SCALAR\n"
        "#ifdef MISSING\n"
        "const HIDDEN = 1;\n"
        "#endif\n"
        "#undef WIDE\n"
        "const W = WIDE;\n"
        "#endif\n"
    )
    out = preprocess(src, ["VEC", "ELEM=f16", "TILE=32u", "TILE_K=32"], tmp_path)
    assert out.split("\n") == [
        "var<storage> a: array<vec4<f16>>;",
        "const N = 32u * 2u; // TILE_2 stays",
        "const K2 = 1;",
        "const W = WIDE;",
        "",
    ]
    scalar = preprocess(src, ["ELEM=f32", "TILE_K=16", "SCALAR"], tmp_path)
    assert "var<storage> a: array<f32>;" in scalar and "const NOVEC = 1;" in scalar and "const W" not in scalar


@pytest.mark.parametrize(
    ("expr", "value"),
    [("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("!A || B == 0", 1), ("A << 2 >= 8", 1), ("7 / 0", 0), ("-7 / 2", -3)],
)
def test_if_expressions(expr: str, value: int) -> None:
    assert evaluate(expr, {"A": "2", "B": "A - 2"}) == value


@pytest.mark.parametrize(
    ("src", "message"),
    [("#pragma x\n", "unknown directive"), ("#ifdef A\n", "unclosed"), ("#endif\n", "without"), ("R\n", "recursive")],
)
def test_errors(src: str, message: str) -> None:
    with pytest.raises(PreprocessError, match=message):
        preprocess(src, ["R=R + 1"])


def test_grid_splits_like_theirs() -> None:
    """128 x 128 output tiles (their H200 instantiation); more than 65535 workgroups go onto y."""
    tile, sg = LlamaTile(2, 4, 4, 2, 32), {"m": 16, "n": 16, "k": 16}
    assert their_grid(tile, sg, 8192, 8192) == (4096, 1)
    assert their_grid(tile, sg, 4097, 128) == (33, 1)
    assert their_grid(tile, sg, 128 * 300, 128 * 300) == (45000, 2)
