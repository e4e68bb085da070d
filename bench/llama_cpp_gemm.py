"""llama.cpp's WebGPU tensor-core GEMM on our Dawn device, next to our kernel and torch in the same process.

    python bench/llama_cpp_gemm.py --shaders runs/llama-webgpu                 # sizes 4096,8192
    python bench/llama_cpp_gemm.py --shaders runs/llama-webgpu --max-subgroup-sizes 128  # also 1024 invocations
    python bench/llama_cpp_gemm.py --shaders runs/llama-webgpu --sizes 4096 --tiles "2,4,4,2,32;4,2,2,4,32"
    WGPU_BACKEND_TYPE=Null python bench/llama_cpp_gemm.py --shaders runs/llama-webgpu --compile-only

Their kernel (ggml-webgpu's wgsl-shaders/mul_mat_subgroup_matrix.wgsl, MIT) is not part of this repository:
--shaders names a directory holding an export of ggml/src/ggml-webgpu (wgsl-shaders/*.wgsl and *.tmpl, plus
ggml-webgpu-shader-lib.hpp, whose WEBGPU_MUL_MAT_SUBGROUP_* constants give the tile), read at run time.
This file holds our own preprocessor for their #include / #define / #undef / #if(n)def / #if / #elif / #else
directives (the semantics of their pre_wgsl.hpp: defines given up front win over the shader's own #define,
macros expand token by token on active lines) and instantiates the kernel the way their
get_mul_mat_fast_pipeline does for an F16 weight (src0) and F32 or F16 activations (src1): VEC when K and M
are multiples of 4, the adapter's first f16 x f16 -> f16 subgroup-matrix config (16 x 16 x 16 on the H200)
and Dawn's AdapterInfo.subgroupMaxSize as MAX_SUBGROUP_SIZE (32 on the H200: 256 invocations, 8 subgroups);
their params struct, bindings (src0, src1, dst, params) and 1-D workgroup grid.

Shapes: their src0 is the weight [M, K], src1 the activations [N, K], dst [N, M] = src1 . src0^T, i.e. our
"nt" C = A . W^T with A = src1; compared at M = N = K. TFLOP/s = 2 M N K / wall time per call, timed as
bench/gemm_tc.py times ours (the median of 3 windows of `reps` calls recorded in one step after a warm-up
window); gpu_us by timestamp queries (bench.gemm_tc.gpu_time). max_rel_err: |C - ref| / max |ref| over 8
sampled rows, ref in float64 from the f16-rounded operands (their accumulators are f16: the error shows it).
Ours: bench.gemm_tc.time_gemm (F16 nt, A f16 and f32); torch: bench.gemm_tc.torch_tflops.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHADER = "mul_mat_subgroup_matrix.wgsl"
SHADER_LIB = "ggml-webgpu-shader-lib.hpp"
_IDENT = re.compile(r"[A-Za-z0-9_]+")  # pre_wgsl's identifier characters (digits included: 16u is one token)
_EXPR_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_]\w*)|(==|!=|<=|>=|&&|\|\||<<|>>|[-+*/%<>!()]))")
_BINARY = {
    "||": 1,
    "&&": 2,
    "==": 3,
    "!=": 3,
    "<": 4,
    ">": 4,
    "<=": 4,
    ">=": 4,
    "<<": 5,
    ">>": 5,
    "+": 6,
    "-": 6,
    "*": 7,
    "/": 7,
    "%": 7,
}


class PreprocessError(ValueError):
    """A shader directive our preprocessor cannot follow (unknown directive, unbalanced #if, recursion)."""


# ---- preprocessor ----------------------------------------------------------------------------------------


def parse_defines(defines: list[str]) -> dict[str, str]:
    """["NAME=VALUE", "NAME", ...] -> {NAME: VALUE or ""}."""
    out = {}
    for d in defines:
        name, _, value = d.partition("=")
        out[name.strip()] = value.strip()
    return out


def expand(line: str, macros: dict[str, str], visiting: frozenset[str] = frozenset()) -> str:
    """Replace every macro token of a line by its (recursively expanded) value."""

    def one(m: re.Match) -> str:
        name = m.group(0)
        if name not in macros:
            return name
        if name in visiting:
            raise PreprocessError(f"recursive macro {name}")
        return expand(macros[name], macros, visiting | {name})

    return _IDENT.sub(one, line)


def evaluate(expr: str, macros: dict[str, str], visiting: frozenset[str] = frozenset()) -> int:
    """The integer value of an #if / #elif expression (C operators, defined(X), undefined names are 0, a name
    defined empty is 1, another name the value of its definition)."""
    tokens: list[str] = []
    pos = 0
    while pos < len(expr) and expr[pos:].strip():
        m = _EXPR_TOKEN.match(expr, pos)
        if m is None:
            raise PreprocessError(f"cannot parse #if expression {expr!r}")
        tokens.append(m.group(m.lastindex))
        pos = m.end()
    tokens.append("")
    at = [0]

    def peek() -> str:
        return tokens[at[0]]

    def take() -> str:
        at[0] += 1
        return tokens[at[0] - 1]

    def primary() -> int:
        tok = take()
        if tok == "(":
            v = binary(1)
            if take() != ")":
                raise PreprocessError(f"missing ) in {expr!r}")
            return v
        if tok in ("!", "-", "+"):
            v = primary()
            return int(not v) if tok == "!" else (-v if tok == "-" else v)
        if tok.isdigit():
            return int(tok)
        if tok == "defined":
            paren = peek() == "("
            if paren:
                take()
            name = take()
            if paren and take() != ")":
                raise PreprocessError(f"missing ) in defined() of {expr!r}")
            return int(name in macros)
        if tok and (tok[0].isalpha() or tok[0] == "_"):
            if tok not in macros:
                return 0
            if not macros[tok]:
                return 1
            if tok in visiting:
                raise PreprocessError(f"recursive macro {tok}")
            return evaluate(macros[tok], macros, visiting | {tok})
        raise PreprocessError(f"unexpected {tok!r} in #if expression {expr!r}")

    def binary(min_prec: int) -> int:
        v = primary()
        while _BINARY.get(peek(), 0) >= min_prec:
            op = take()
            v = _apply(op, v, binary(_BINARY[op] + 1))
        return v

    v = binary(1)
    if peek() != "":
        raise PreprocessError(f"trailing {peek()!r} in #if expression {expr!r}")
    return v


def _apply(op: str, a: int, b: int) -> int:
    if op == "/":
        return 0 if b == 0 else int(a / b)
    if op == "%":
        return 0 if b == 0 else a - int(a / b) * b
    ops: dict[str, Callable[[int, int], int]] = {
        "||": lambda x, y: int(bool(x) or bool(y)),
        "&&": lambda x, y: int(bool(x) and bool(y)),
        "==": lambda x, y: int(x == y),
        "!=": lambda x, y: int(x != y),
        "<": lambda x, y: int(x < y),
        ">": lambda x, y: int(x > y),
        "<=": lambda x, y: int(x <= y),
        ">=": lambda x, y: int(x >= y),
        "<<": lambda x, y: x << y,
        ">>": lambda x, y: x >> y,
        "+": lambda x, y: x + y,
        "-": lambda x, y: x - y,
        "*": lambda x, y: x * y,
    }
    return ops[op](a, b)


def preprocess(text: str, defines: list[str], include_dir: Path | None = None) -> str:
    """The shader text after its directives: `defines` ("NAME=VALUE" / "NAME") are set first and win over the
    shader's own #define / #undef of the same name; #include "f" reads include_dir / f."""
    macros = parse_defines(defines)
    return _process(text, macros, frozenset(macros), include_dir, ())


def _process(text: str, macros: dict[str, str], fixed: frozenset[str], inc: Path | None, stack: tuple) -> str:
    out: list[str] = []
    cond: list[list[bool]] = []  # [parent_active, active, taken]
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip().startswith("#"):
            if not cond or cond[-1][1]:
                out.append(expand(line, macros) + "\n")
            continue
        while line.rstrip().endswith("\\") and i < len(lines):
            line = line.rstrip()[:-1] + "\n" + lines[i]
            i += 1
        cmd, rest = (line.strip()[1:].split(None, 1) + ["", ""])[:2]
        rest = rest.strip()
        active = not cond or cond[-1][1]
        if cmd == "include":
            if active:
                name = rest.split()[0].strip('"')
                if inc is None or name in stack:
                    raise PreprocessError(f"#include {name!r}: no include directory or a recursive include")
                sub = (inc / name).read_text()
                out.append(_process(sub, macros, fixed, inc, (*stack, name)))
        elif cmd == "define":
            name, value = (rest.split(None, 1) + [""])[:2]
            if active and name not in fixed:
                macros[name] = value.strip()
        elif cmd == "undef":
            if active and rest.split()[0] not in fixed:
                macros.pop(rest.split()[0], None)
        elif cmd in ("ifdef", "ifndef"):
            v = (rest.split()[0] in macros) == (cmd == "ifdef")
            cond.append([active, active and v, active and v])
        elif cmd == "if":
            v = active and evaluate(rest, macros) != 0
            cond.append([active, v, v])
        elif cmd in ("elif", "else"):
            if not cond:
                raise PreprocessError(f"#{cmd} without #if")
            c = cond[-1]
            if not c[0] or c[2]:
                c[1] = False
            else:
                c[1] = cmd == "else" or evaluate(rest, macros) != 0
                c[2] = c[1]
        elif cmd == "endif":
            if not cond:
                raise PreprocessError("#endif without #if")
            cond.pop()
        else:
            raise PreprocessError(f"unknown directive #{cmd}")
    if cond:
        raise PreprocessError("unclosed #if")
    return "".join(out)


# ---- their kernel ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaTile:
    """Their tile: subgroups per workgroup (M x N), subgroup matrices per subgroup (M x N), K per stage."""

    subgroup_m: int
    subgroup_n: int
    subgroup_matrix_m: int
    subgroup_matrix_n: int
    tile_k: int

    @property
    def label(self) -> str:
        return f"{self.subgroup_m},{self.subgroup_n},{self.subgroup_matrix_m},{self.subgroup_matrix_n},{self.tile_k}"


def their_tile(shader_dir: Path) -> LlamaTile:
    """The WEBGPU_MUL_MAT_SUBGROUP_* constants of their ggml-webgpu-shader-lib.hpp (the F16 TILE_K_FLOAT)."""
    path = shader_dir / SHADER_LIB
    consts = dict(re.findall(r"#define\s+WEBGPU_MUL_MAT_SUBGROUP_(\w+)\s+(\d+)", path.read_text()))
    try:
        return LlamaTile(
            int(consts["M"]),
            int(consts["N"]),
            int(consts["MATRIX_M"]),
            int(consts["MATRIX_N"]),
            int(consts["TILE_K_FLOAT"]),
        )
    except KeyError as e:
        raise SystemExit(
            f"{path}: no #define WEBGPU_MUL_MAT_SUBGROUP_{e.args[0]} (--shaders export incomplete?)"
        ) from e


def parse_tiles(text: str) -> list[LlamaTile]:
    """'sg_m,sg_n,mat_m,mat_n,tile_k;...' -> tiles."""
    return [LlamaTile(*[int(x) for x in s.split(",")]) for s in text.split(";") if s]


def kernel_defines(tile: LlamaTile, sg: dict[str, int], max_subgroup: int, src1: str, vec: bool) -> list[str]:
    """The defines their get_mul_mat_fast_pipeline passes for an F16 src0 on the subgroup-matrix path."""
    return [
        f"SRC1_INNER_TYPE={src1}",
        "SRC0_INNER_TYPE=f16",
        "FLOAT",
        "MUL_ACC_FLOAT",
        "INIT_SRC0_SHMEM_FLOAT",
        "INIT_SRC1_SHMEM_FLOAT",
        "VEC" if vec else "SCALAR",
        "TILE_M=4u",
        "TILE_N=4u",
        f"TILE_K={tile.tile_k}u",
        f"MAX_SUBGROUP_SIZE={max_subgroup}u",
        f"SUBGROUP_M={tile.subgroup_m}u",
        f"SUBGROUP_N={tile.subgroup_n}u",
        f"SUBGROUP_MATRIX_M={tile.subgroup_matrix_m}u",
        f"SUBGROUP_MATRIX_N={tile.subgroup_matrix_n}u",
        f"SUBGROUP_MATRIX_M_SIZE={sg['m']}u",
        f"SUBGROUP_MATRIX_N_SIZE={sg['n']}u",
        f"SUBGROUP_MATRIX_K_SIZE={sg['k']}u",
    ]


def kernel_source(shader_dir: Path, defines: list[str]) -> str:
    """Their shader, preprocessed with `defines` (includes from the shader directory)."""
    folder = shader_dir / "wgsl-shaders"
    return preprocess((folder / SHADER).read_text(), defines, folder)


def their_params(m: int, n: int, k: int) -> bytes:
    """Their MulMatParams for one 2-D product: offsets 0, row strides K, one batch, no broadcast."""
    return np.array([0, 0, 0, m, n, k, k, k, m * k, n * k, m * k, n * k, 1, 1, 1, 1], np.uint32).tobytes()


def their_grid(tile: LlamaTile, sg: dict[str, int], m: int, n: int, max_per_dim: int = 65535) -> tuple[int, int]:
    """Their workgroup count (one per M x N output tile) split over x and y like compute_2d_workgroups."""
    wg_m = -(-m // (tile.subgroup_m * tile.subgroup_matrix_m * sg["m"]))
    wg_n = -(-n // (tile.subgroup_n * tile.subgroup_matrix_n * sg["n"]))
    total = wg_m * wg_n
    y = max(1, -(-total // max_per_dim))
    return -(-total // y), y


def dawn_subgroup_max_size(dev: Any) -> int | None:
    """Dawn's AdapterInfo.subgroupMaxSize, what llama.cpp reads (wgpudawn's adapter.info has no such field: its
    "stackgroup_max_size" is a default 128, whatever the GPU); None off Dawn."""
    if dev.backend != "dawn":
        return None
    from wgpudawn.backends.dawn import extras

    info = extras.new_struct_p("WGPUAdapterInfo *")
    if extras.libf.wgpuAdapterGetInfo(dev.adapter._internal, info) != extras.lib.WGPUStatus_Success:
        return None
    size = int(info.subgroupMaxSize)
    extras.libf.wgpuAdapterInfoFreeMembers(info[0])
    return size


def subgroup_config(dev: Any, fallback: str) -> tuple[dict[str, int], int, str]:
    """Their choice on this adapter: the first f16 x f16 -> f16 subgroup-matrix config and Dawn's max subgroup
    size; `fallback` "m,n,k" where the adapter reports no config (Dawn's Null backend)."""
    configs = []
    if dev.backend == "dawn":
        from wgpudawn.backends.dawn import extras

        configs = extras.get_adapter_properties(dev.adapter).get("subgroup_matrix_configs") or []
    first = next(
        (c for c in configs if str(c["component_type"]) == "f16" and str(c["result_component_type"]) == "f16"), None
    )
    max_sg = dawn_subgroup_max_size(dev) or (int(first["max_subgroup_size"]) if first else 32)
    if first is None:
        m, n, k = (int(x) for x in fallback.split(","))
        return {"m": m, "n": n, "k": k}, max_sg, "fallback (adapter reports no f16 config)"
    sg = {key: int(first[key]) for key in ("m", "n", "k")}
    return sg, max_sg, "adapter's first f16 x f16 -> f16 config"


def time_call(dev: Any, call: Callable[[], None], flops: float, seconds: float) -> dict[str, Any]:
    """bench/gemm_tc.py's timing of one call (time_calls: the median of 3 windows after a warm-up), as TFLOP/s;
    gpu_us by timestamp queries."""
    from bench.gemm_tc import gpu_time, time_calls

    timing = time_calls(dev, call, seconds)
    t = timing["seconds"]
    out = {"ms": round(t * 1e3, 4), "tflops": round(flops / t / 1e12, 2)}
    out |= {key: timing[key] for key in ("reps", "spread", "first_call_s")} | gpu_time(dev, call)
    if "gpu_us" in out:
        out["gpu_tflops"] = round(flops / (out["gpu_us"] * 1e-6) / 1e12, 2)
    return out


def time_theirs(
    dev: Any,
    shader_dir: Path,
    tile: LlamaTile,
    sg: dict[str, int],
    max_sg: int,
    size: int,
    src1_type: str,
    seconds: float,
    check_rows: int = 8,
) -> dict[str, Any]:
    """Their kernel on dst[N, M] = src1[N, K] . src0[M, K]^T at M = N = K = size: timed and checked."""
    m = n = k = size
    vec = k % 4 == 0 and m % 4 == 0
    defines = kernel_defines(tile, sg, max_sg, src1_type, vec)
    rng = np.random.default_rng(0)
    src0 = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    src1 = rng.standard_normal((n, k), dtype=np.float32)
    src1_host = src1.astype(np.float16) if src1_type == "f16" else src1
    out: dict[str, Any] = {"src0": "f16", "src1": src1_type, "m": m, "n": n, "k": k, "tile": tile.label}
    out["max_subgroup_size"] = max_sg
    out["vec"] = vec
    out["wg_tile"] = [
        tile.subgroup_m * tile.subgroup_matrix_m * sg["m"],
        tile.subgroup_n * tile.subgroup_matrix_n * sg["n"],
    ]
    out["workgroup_size"] = tile.subgroup_m * tile.subgroup_n * max_sg
    grid = their_grid(tile, sg, m, n, int(dev.limits.get("max-compute-workgroups-per-dimension", 65535)))
    out["grid"] = list(grid)
    try:
        pipe = dev.pipeline(("llama_cpp_mul_mat_subgroup_matrix", *defines), lambda: kernel_source(shader_dir, defines))
        a0, a1 = dev.upload(src0, label="llama_src0"), dev.upload(src1_host, label="llama_src1")
        dst = dev.buffer(n * m * 4, label="llama_dst")
        params = their_params(m, n, k)
        out.update(time_call(dev, lambda: dev.dispatch(pipe, [a0, a1, dst, params], grid), 2.0 * m * n * k, seconds))
    except Exception as e:  # noqa: BLE001 - the other results of the run still print
        out["error"] = str(e)[-600:]
        return out
    rows = np.sort(rng.choice(n, size=min(check_rows, n), replace=False))
    c = np.stack([dev.read(dst, np.float32, (m,), offset=int(r) * m * 4) for r in rows]).astype(np.float64)
    ref = src1[rows].astype(np.float16).astype(np.float64) @ src0.astype(np.float64).T
    out["max_rel_err"] = float(np.abs(c - ref).max() / np.abs(ref).max())
    out["max_abs_ref"] = round(float(np.abs(ref).max()), 2)
    return out


def compile_only(dev: Any, shader_dir: Path, tiles: list[LlamaTile], sg: dict[str, int], max_sg: int) -> list[dict]:
    """Preprocess and compile (Tint, no pipeline: the Null backend's limits are small) every instantiation."""
    results = []
    for tile in tiles:
        for src1 in ("f32", "f16"):
            for vec in (True, False):
                src = kernel_source(shader_dir, kernel_defines(tile, sg, max_sg, src1, vec))
                res: dict[str, Any] = {"tile": tile.label, "src1": src1, "vec": vec, "lines": src.count("\n")}
                try:
                    dev.device.create_shader_module(code=src)
                    res["compiled"] = True
                except Exception as e:  # noqa: BLE001 - reported per instantiation
                    res["compiled"], res["error"] = False, str(e)[-600:]
                results.append(res)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shaders", required=True, help="export of llama.cpp's ggml/src/ggml-webgpu (not in this repo)")
    ap.add_argument("--sizes", default="4096,8192", help="M = N = K")
    ap.add_argument("--src1", default="f32,f16", help="their activation types (llama.cpp runs f32)")
    ap.add_argument("--tiles", default="", help="extra tiles 'sg_m,sg_n,mat_m,mat_n,tile_k;...' besides theirs")
    ap.add_argument("--seconds", type=float, default=0.25, help="length of one timing window")
    ap.add_argument("--max-subgroup-sizes", default="", help="extra MAX_SUBGROUP_SIZE values to time (e.g. 128)")
    ap.add_argument("--sg-fallback", default="16,16,16", help="subgroup-matrix m,n,k where the adapter reports none")
    ap.add_argument("--compile-only", action="store_true", help="preprocess + Tint compile only (e.g. Dawn Null)")
    ap.add_argument("--no-ours", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    shader_dir = Path(args.shaders)
    if not (shader_dir / "wgsl-shaders" / SHADER).is_file():
        raise SystemExit(f"--shaders {shader_dir}: no wgsl-shaders/{SHADER} (export ggml/src/ggml-webgpu there)")
    from gpu.device import Device

    dev = Device(backend="dawn")
    sg, max_sg, sg_source = subgroup_config(dev, args.sg_fallback)
    tiles = [their_tile(shader_dir), *parse_tiles(args.tiles)]
    source = (shader_dir / "SOURCE").read_text().strip() if (shader_dir / "SOURCE").is_file() else "unknown"
    head: dict[str, Any] = {
        "bench": "llama_cpp_gemm",
        "their_source": source,
        "adapter": dev.adapter.summary,
        "backend": dev.backend,
        "subgroup_matrix": {**sg, "max_subgroup_size": max_sg, "chosen_by": sg_source},
        "their_tile": asdict(tiles[0]),
    }
    if args.compile_only:
        print(json.dumps({**head, "compiled": compile_only(dev, shader_dir, tiles, sg, max_sg)}, indent=1))
        return
    from bench.gemm_tc import time_gemm, torch_tflops
    from gpu.ops.matmul_tc import tensor_core_problem

    problem = tensor_core_problem(dev)
    if problem is not None:
        print(json.dumps({**head, "error": problem}))
        sys.exit(1)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    max_sizes = list(dict.fromkeys([max_sg, *(int(x) for x in args.max_subgroup_sizes.split(",") if x)]))
    theirs = [
        time_theirs(dev, shader_dir, tile, sg, ms, size, src1, args.seconds)
        for size in sizes
        for tile in tiles
        for ms in max_sizes
        for src1 in args.src1.split(",")
        if src1
    ]
    ours = (
        []
        if args.no_ours
        else [
            time_gemm(dev, "F16", "nt", s, s, s, a_dtype=a, seconds=args.seconds) for s in sizes for a in ("f16", "f32")
        ]
    )
    out = {**head, "llama_cpp": theirs, "ours": ours, "torch": {} if args.no_torch else torch_tflops(sizes)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
