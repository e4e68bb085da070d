"""Compose WGSL kernels from gpu/kernels/: the kernel text and template filling every kernel uses, the weight
types' decode snippets, and the f32 matmul generator (generated constants, fully unrolled register blocking).

Every weight type has one snippet `decode_<type>.wgsl` defining `decode4(n, k, K) -> vec4<f32>`
(= W[n, k..k+3], k % 4 == 0) on a binding named `W`; quantized types also include `decode_common.wgsl`
(byte helpers). A kernel template uses `${NAME}` placeholders (string.Template). The op kernels (skeletons,
includes and bodies joined per variant) are listed in gpu/registry.py. Another matmul template registers its
generator in MATMUL_TEMPLATES (the tensor-core kernels live in gpu/codegen_tc.py and reuse decode_snippet /
fill / kernel_text).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from string import Template

KERNEL_DIR = Path(__file__).parent / "kernels"
MATMUL_PARAMS = "matmul_params.wgsl"  # the uniform block of every matmul kernel (GemmShape.params fills it)


@dataclass(frozen=True)
class WeightType:
    """How a GGML weight type is bound and decoded in WGSL."""

    name: str  # GGMLQuantizationType name, e.g. "Q4_K"
    snippet: str  # decode_<type>.wgsl
    w_elem: str  # element type of the W binding
    block: int  # weights per block (K must be a multiple of it)
    quantized: bool


WEIGHT_TYPES: dict[str, WeightType] = {
    t.name: t
    for t in (
        WeightType("F32", "decode_f32.wgsl", "vec4<f32>", 4, False),
        WeightType("F16", "decode_f16.wgsl", "u32", 4, False),
        WeightType("Q4_0", "decode_q4_0.wgsl", "u32", 32, True),
        WeightType("Q4_1", "decode_q4_1.wgsl", "u32", 32, True),
        WeightType("Q5_0", "decode_q5_0.wgsl", "u32", 32, True),
        WeightType("Q5_1", "decode_q5_1.wgsl", "u32", 32, True),
        WeightType("Q8_0", "decode_q8_0.wgsl", "u32", 32, True),
        WeightType("Q4_K", "decode_q4_k.wgsl", "u32", 256, True),
        WeightType("Q6_K", "decode_q6_k.wgsl", "u32", 256, True),
    )
}


@cache
def kernel_text(filename: str) -> str:
    """The text of gpu/kernels/<filename>."""
    path = KERNEL_DIR / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such kernel file")
    return path.read_text()


def decode_snippet(wtype: str) -> str:
    """WGSL defining decode4() for weight type `wtype` (with the shared byte helpers when quantized)."""
    if wtype not in WEIGHT_TYPES:
        raise ValueError(f"weight type {wtype!r} has no GPU decoder; supported: {sorted(WEIGHT_TYPES)}")
    t = WEIGHT_TYPES[wtype]
    common = kernel_text("decode_common.wgsl") + "\n" if t.quantized else ""
    return common + kernel_text(t.snippet)


def fill(template: str, **values: object) -> str:
    """Substitute ${NAME} placeholders; a missing value is an error naming it."""
    try:
        return Template(template).substitute({k: str(v) for k, v in values.items()})
    except KeyError as e:
        raise KeyError(f"kernel template placeholder {e} has no value") from None


@dataclass(frozen=True)
class TileConfig:
    """Register-blocking tile: a workgroup computes bm x bp outputs, bm/tm x bp/tn threads of tm x tn each,
    staging br reduction steps at a time. unroll=True unrolls the br loop too."""

    bm: int
    bp: int
    br: int
    tm: int
    tn: int
    unroll: bool = True

    @property
    def tx(self) -> int:
        return self.bp // self.tn

    @property
    def ty(self) -> int:
        return self.bm // self.tm

    @property
    def threads(self) -> int:
        return self.tx * self.ty

    @property
    def workgroup_bytes(self) -> int:
        return 4 * self.br * (self.bm + self.bp)

    def validate(self, max_threads: int = 256, max_workgroup_bytes: int = 16384) -> None:
        """Raise ValueError when the tile cannot be generated or exceeds the given device limits."""
        for name in ("tm", "tn", "br"):
            if getattr(self, name) % 4 or getattr(self, name) <= 0:
                raise ValueError(f"TileConfig.{name}={getattr(self, name)} must be a positive multiple of 4")
        if self.bm % self.tm or self.bp % self.tn:
            raise ValueError(f"TileConfig bm={self.bm}, bp={self.bp} must be multiples of tm={self.tm}, tn={self.tn}")
        if not 1 <= self.threads <= max_threads:
            raise ValueError(f"TileConfig {self} needs {self.threads} threads; the device allows {max_threads}")
        if self.workgroup_bytes > max_workgroup_bytes:
            raise ValueError(
                f"TileConfig {self} needs {self.workgroup_bytes} B of workgroup memory; "
                f"the device allows {max_workgroup_bytes}"
            )


@dataclass(frozen=True)
class MatmulVariant:
    """One compiled matmul kernel: weight type x orientation x A layout x store mode x tile."""

    wtype: str
    orient: str  # "nt": C = A . W^T (forward); "nn": C = A . W (input gradient)
    tile: TileConfig
    trans_a: bool = False  # A stored [R, M]
    accumulate: bool = False  # C += alpha * A.B instead of C = alpha * A.B

    template: str = "matmul_f32.wgsl"  # a key of MATMUL_TEMPLATES

    @property
    def key(self) -> tuple:
        return ("matmul", self)


def _compute_block(t: TileConfig, rr: str) -> list[str]:
    """One reduction step: load tm/4 + tn/4 vec4s from workgroup memory, tm*tn/4 vec4 FMAs."""
    lines = []
    for i in range(t.tm // 4):
        lines.append(f"let a{i} = As[{rr} * BMV + ty + {i}u * TY];")
    for j in range(t.tn // 4):
        lines.append(f"let b{j} = Bs[{rr} * BPV + tx + {j}u * TX];")
    for i in range(t.tm // 4):
        for c in "xyzw":
            for j in range(t.tn // 4):
                acc = f"acc_{i}{c}_{j}"
                lines.append(f"{acc} = fma(vec4<f32>(a{i}.{c}), b{j}, {acc});")
    return lines


def _matmul_f32_source(v: MatmulVariant) -> str:
    t = v.tile
    t.validate(max_threads=1024, max_workgroup_bytes=1 << 30)
    if v.orient not in ("nt", "nn"):
        raise ValueError(f"matmul orientation {v.orient!r}: expected 'nt' or 'nn'")
    ind = " " * 8
    acc_names = [f"acc_{i}{c}_{j}" for i in range(t.tm // 4) for c in "xyzw" for j in range(t.tn // 4)]
    acc_decl = "\n".join(f"    var {a} = vec4<f32>(0.0);" for a in acc_names)
    if t.unroll:
        body = []
        for r in range(t.br):
            body += ["{"] + ["    " + s for s in _compute_block(t, f"{r}u")] + ["}"]
        compute = "\n".join(ind + s for s in body)
    else:
        body = ["for (var rr = 0u; rr < BR; rr++) {"] + ["    " + s for s in _compute_block(t, "rr")] + ["}"]
        compute = "\n".join(ind + s for s in body)
    store = []
    for i in range(t.tm // 4):
        for ci, c in enumerate("xyzw"):
            for j in range(t.tn // 4):
                m = f"m0 + (ty + {i}u * TY) * 4u + {ci}u"
                store.append(f"    store4({m}, p0 + (tx + {j}u * TX) * 4u, acc_{i}{c}_{j});")
    out = "C[row + p + e]"
    store_expr = f"{out} = {out} + prm.alpha * v[e];" if v.accumulate else f"{out} = prm.alpha * v[e];"
    if v.trans_a:
        a_index, a_unit_r, a_unit_m = "r * prm.lda + m", "u / BMV", "u % BMV"
    else:
        a_index, a_unit_r, a_unit_m = "m * prm.lda + r", "u % BR", "u / BR"
    return fill(
        kernel_text(v.template),
        PARAMS=kernel_text(MATMUL_PARAMS),
        DECODE=decode_snippet(v.wtype),
        W_ELEM=WEIGHT_TYPES[v.wtype].w_elem,
        BM=t.bm,
        BP=t.bp,
        BR=t.br,
        TX=t.tx,
        TY=t.ty,
        THREADS=t.threads,
        AS_LEN=t.br * t.bm // 4,
        BS_LEN=t.br * t.bp // 4,
        A_INDEX=a_index,
        A_UNIT_R=a_unit_r,
        A_UNIT_M=a_unit_m,
        STAGE_B=f"stage_b_{v.orient}",
        STORE_EXPR=store_expr,
        ACC_DECL=acc_decl,
        COMPUTE=compute,
        STORE="\n".join(store),
    )


# template file -> source generator.
MATMUL_TEMPLATES = {"matmul_f32.wgsl": _matmul_f32_source}


def matmul_source(v: MatmulVariant) -> str:
    """Full WGSL for one matmul variant."""
    if v.template not in MATMUL_TEMPLATES:
        raise ValueError(f"no generator for matmul template {v.template!r}; known: {sorted(MATMUL_TEMPLATES)}")
    return MATMUL_TEMPLATES[v.template](v)


def t16_values(half: bool, binding: int, store: str) -> dict[str, str]:
    """Template values of a LoRA pass whose variant half also stores its result as f16 into T16 (`binding`), by the
    WGSL statement `store` (lora_reduce.wgsl, lora_thin_i8_finish.wgsl)."""
    if not half:
        return {"ENABLE_F16": "", "T16_BINDING": "", "T16_STORE": ""}
    return {
        "ENABLE_F16": "enable f16;",
        "T16_BINDING": f"@group(0) @binding({binding}) var<storage, read_write> T16: array<f16>;",
        "T16_STORE": store,
    }
