"""Generate the tensor-core matmul kernels (gpu/kernels/matmul_tc.wgsl) for Dawn's subgroup matrices.

A `TCConfig` fixes the workgroup shape: SG_M x SG_N subgroups of 32 invocations, each owning TM x TN result
matrices of 16 x 16 (f32), BK reduction steps staged per iteration as f16 in workgroup memory, optionally
double-buffered with a register prefetch. A `TCVariant` adds what the kernel binds and computes: weight type
(its decode snippet from gpu/codegen.py), orientation, A's element type and access width, accumulate.
The reduction and epilogue code is generated fully unrolled, with one named variable per result matrix (no
private arrays of subgroup matrices, which would spill).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gpu.codegen import WEIGHT_TYPES, decode_snippet, fill, kernel_text

SUBGROUP_SIZE = 32  # invocations per subgroup the kernels are generated for (NVIDIA)
MATRIX = 16  # side of one subgroup matrix (the f16 -> f32 config M16 N16 K16)


@dataclass(frozen=True)
class TCConfig:
    """Workgroup tile of the tensor-core GEMM (sizes in elements unless noted)."""

    sg_m: int  # subgroups along M
    sg_n: int  # subgroups along P
    tm: int  # 16 x 16 result matrices per subgroup along M
    tn: int  # ... along P
    bk: int = 32  # reduction steps staged per iteration (multiple of 16)
    prefetch: bool = False  # register prefetch of the next step + two workgroup buffers
    pad: int = 8  # f16 padding per staged row (keeps the matrix loads off shared bank conflicts)
    sg_from_lid: bool = False  # subgroup index as local_invocation_index / 32 instead of @builtin(subgroup_id)

    @property
    def bm(self) -> int:
        return self.sg_m * self.tm * MATRIX

    @property
    def bn(self) -> int:
        return self.sg_n * self.tn * MATRIX

    @property
    def subgroups(self) -> int:
        return self.sg_m * self.sg_n

    @property
    def threads(self) -> int:
        return self.subgroups * SUBGROUP_SIZE

    @property
    def buffers(self) -> int:
        return 2 if self.prefetch else 1

    def b_stride(self, orient: str) -> int:
        """Row stride of the staged B tile: [BN][BK] for "nt", [BK][BN] for "nn"."""
        return self.bk + self.pad if orient == "nt" else self.bn + self.pad

    def b_tile(self, orient: str) -> int:
        return (self.bn if orient == "nt" else self.bk) * self.b_stride(orient)

    def workgroup_bytes(self, orient: str) -> int:
        a_tile = self.bm * (self.bk + self.pad)
        return 2 * self.buffers * (a_tile + self.b_tile(orient)) + 4 * self.subgroups * MATRIX * MATRIX

    def validate(self, orient: str, max_threads: int = 1024, max_workgroup_bytes: int = 49152) -> None:
        """Raise ValueError when the tile cannot be generated or exceeds the given device limits."""
        for name in ("sg_m", "sg_n", "tm", "tn", "bk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TCConfig.{name}={getattr(self, name)} must be positive")
        if self.bk % MATRIX:
            raise ValueError(f"TCConfig.bk={self.bk} must be a multiple of {MATRIX}")
        if self.pad % 4 or self.pad < 0:
            raise ValueError(f"TCConfig.pad={self.pad} must be a non-negative multiple of 4")
        if self.threads > max_threads:
            raise ValueError(f"TCConfig {self} needs {self.threads} threads; the device allows {max_threads}")
        if self.workgroup_bytes(orient) > max_workgroup_bytes:
            raise ValueError(
                f"TCConfig {self} ({orient}) needs {self.workgroup_bytes(orient)} B of workgroup memory; "
                f"the device allows {max_workgroup_bytes}"
            )


@dataclass(frozen=True)
class TCVariant:
    """One compiled tensor-core matmul kernel."""

    wtype: str  # GGML weight type name, e.g. "Q4_K"
    orient: str  # "nt": C = A . W^T (forward); "nn": C = A . W (input gradient)
    cfg: TCConfig
    a_type: str = "f32"  # element type of A in memory: "f32" or "f16"
    a_vec: bool = True  # A read 4 elements at a time (needs lda, a_offset, R multiples of 4)
    accumulate: bool = False  # C += alpha * A.B instead of C = alpha * A.B

    @property
    def key(self) -> tuple:
        return ("matmul_tc", self)


_A_LOAD = {
    ("f32", True): (
        "vec4<f32>",
        """fn a4(m: u32, r: u32) -> vec4<f16> {
    return vec4<f16>(A[(prm.a_off + m * prm.lda + r) / 4u]);
}""",
    ),
    ("f32", False): (
        "f32",
        """fn a1(m: u32, r: u32) -> f32 {
    if (r < prm.R) {
        return A[prm.a_off + m * prm.lda + r];
    }
    return 0.0;
}

fn a4(m: u32, r: u32) -> vec4<f16> {
    return vec4<f16>(vec4<f32>(a1(m, r), a1(m, r + 1u), a1(m, r + 2u), a1(m, r + 3u)));
}""",
    ),
    ("f16", True): (
        "vec2<u32>",
        """fn a4(m: u32, r: u32) -> vec4<f16> {
    return ${H4}(A[(prm.a_off + m * prm.lda + r) / 4u]);
}""",
    ),
    ("f16", False): (
        "u32",
        """fn a1(m: u32, r: u32) -> f16 {
    if (r < prm.R) {
        let i = prm.a_off + m * prm.lda + r;
        return ${H2}(A[i >> 1u])[i & 1u];
    }
    return 0.0h;
}

fn a4(m: u32, r: u32) -> vec4<f16> {
    return vec4<f16>(a1(m, r), a1(m, r + 1u), a1(m, r + 2u), a1(m, r + 3u));
}""",
    ),
}

_LOAD_B = {
    "nt": """let n = p0 + u / (BK / 4u);
    let k = r0 + (u % (BK / 4u)) * 4u;
    if (n < prm.N && k < prm.K) {
        return vec4<f16>(decode4(n, k, prm.K));
    }
    return vec4<f16>(0.0h);""",
    "nn": """let r = r0 + u / (BN / 4u);
    let p = p0 + (u % (BN / 4u)) * 4u;
    if (r < prm.N && p < prm.K) {
        return vec4<f16>(decode4(r, p, prm.K));
    }
    return vec4<f16>(0.0h);""",
}
_STORE_B_OFFSET = {
    "nt": "(u / (BK / 4u)) * LDB_S + (u % (BK / 4u)) * 4u",
    "nn": "(u / (BN / 4u)) * LDB_S + (u % (BN / 4u)) * 4u",
}
_B_SG = {"nt": "(sg / SG_M) * (TN * 16u) * LDB_S", "nn": "(sg / SG_M) * (TN * 16u)"}

_LEFT = "subgroup_matrix_left<f16, 16, 16>"
_RIGHT = "subgroup_matrix_right<f16, 16, 16>"
_RESULT = "subgroup_matrix_result<f32, 16, 16>"

_DIRECTIVES = """diagnostic(off, chromium.subgroup_matrix_uniformity);
enable f16;
enable subgroups;
enable chromium_experimental_subgroup_matrix;"""

# Emulation: the same kernel without subgroup matrices. A left/right operand is only its load descriptor
# (the tile it names stays in workgroup memory until the next barrier); a result is distributed like the
# real thing: invocation `lane` of its logical subgroup (32 consecutive invocations) holds elements
# lane * 8 .. lane * 8 + 7 (row-major). Element [row][col] maps to memory as the extension defines:
# row-major off + stride * row + col, column-major off + stride * col + row.
_EMULATION = """var<private> emu_lane: u32;

struct EmuH { off: u32, col_major: u32, stride: u32 }

// naga has no width-changing bitcast to f16 vectors
fn emu_h2(q: u32) -> vec2<f16> {
    return vec2<f16>(unpack2x16float(q));
}

fn emu_h4(q: vec2<u32>) -> vec4<f16> {
    return vec4<f16>(emu_h2(q.x), emu_h2(q.y));
}
struct EmuF { v: array<f32, 8> }

fn emu_index(off: u32, row: u32, col: u32, col_major: u32, stride: u32) -> u32 {
    return select(off + stride * row + col, off + stride * col + row, col_major != 0u);
}

fn emu_mma(a: EmuH, b: EmuH, acc: EmuF) -> EmuF {
    var out = acc;
    for (var e = 0u; e < 8u; e++) {
        let row = (emu_lane * 8u + e) / 16u;
        let col = (emu_lane * 8u + e) % 16u;
        var s = out.v[e];
        for (var k = 0u; k < 16u; k++) {
            let x = As[emu_index(a.off, row, k, a.col_major, a.stride)];
            let y = Bs[emu_index(b.off, k, col, b.col_major, b.stride)];
            s += f32(x) * f32(y);
        }
        out.v[e] = s;
    }
    return out;
}

fn emu_store_cs(off: u32, m: EmuF, col_major: u32, stride: u32) {
    for (var e = 0u; e < 8u; e++) {
        let row = (emu_lane * 8u + e) / 16u;
        let col = (emu_lane * 8u + e) % 16u;
        Cs[emu_index(off, row, col, col_major, stride)] = m.v[e];
    }
}
"""


@dataclass(frozen=True)
class _Dialect:
    """How the generated code spells the subgroup-matrix operations."""

    directives: str
    emulation: str
    sg_param: str
    sg_let: str
    result_zero: str
    load_a: str  # format(off=...): left matrix from As, row-major, stride LDA_S
    load_b: str  # format(off=..., cm=...): right matrix from Bs, stride LDB_S
    mma: str  # format(a=..., b=..., acc=...)
    store_c: str  # format(acc=...): result to Cs[sg * 256], row-major, stride 16
    h4: str  # vec2<u32> -> vec4<f16> reinterpretation
    h2: str  # u32 -> vec2<f16>


_TC = _Dialect(
    directives=_DIRECTIVES,
    emulation="",
    sg_param="\n    @builtin(subgroup_id) sg: u32,",
    sg_let="",
    result_zero=f"{_RESULT}()",
    load_a=f"subgroupMatrixLoad<{_LEFT}>(&As, {{off}}, false, LDA_S)",
    load_b=f"subgroupMatrixLoad<{_RIGHT}>(&Bs, {{off}}, {{cm}}, LDB_S)",
    mma="subgroupMatrixMultiplyAccumulate({a}, {b}, {acc})",
    store_c="subgroupMatrixStore(&Cs, sg * 256u, {acc}, false, 16u)",
    h4="bitcast<vec4<f16>>",
    h2="bitcast<vec2<f16>>",
)
_EMU = _Dialect(
    directives="enable f16;",
    emulation=_EMULATION,
    sg_param="",
    sg_let="\n    let sg = lid / 32u;\n    emu_lane = lid % 32u;",
    result_zero="EmuF()",
    load_a="EmuH({off}, 0u, LDA_S)",
    load_b="EmuH({off}, u32({cm}), LDB_S)",
    mma="emu_mma({a}, {b}, {acc})",
    store_c="emu_store_cs(sg * 256u, {acc}, 0u, 16u)",
    h4="emu_h4",
    h2="emu_h2",
)


def _units(total: int, threads: int) -> list[tuple[str, bool]]:
    """(unit index expression, needs a bounds guard) for each of a thread's staging units."""
    n = -(-total // threads)
    return [(f"lid + {e}u * THREADS", (e + 1) * threads > total) for e in range(n)]


def _staging(c: TCConfig, ind: str, *, load: str | None, store: str | None) -> list[str]:
    """Staging lines: load (into registers ra*/rb* when store is None), store (from registers when load is
    None), or both at once (load straight into workgroup memory). `load`/`store` are r0 / buffer exprs."""
    lines = []
    for tile, total in (("a", c.bm * c.bk // 4), ("b", c.bn * c.bk // 4)):
        origin = "m0" if tile == "a" else "p0"
        for e, (u, guard) in enumerate(_units(total, c.threads)):
            reg = f"r{tile}{e}"
            if load is not None and store is not None:
                stmt = f"store_{tile}({u}, {store}, load_{tile}({u}, {origin}, {load}));"
            elif load is not None:
                stmt = f"{reg} = load_{tile}({u}, {origin}, {load});"
            else:
                stmt = f"store_{tile}({u}, {store}, {reg});"
            lines.append(f"{ind}if ({u} < {total}u) {{ {stmt} }}" if guard else ind + stmt)
    return lines


def _compute(c: TCConfig, orient: str, buf: str, ind: str, d: _Dialect) -> list[str]:
    """One staged tile's worth of matrix loads and multiply-accumulates for this subgroup."""
    col_major = "true" if orient == "nt" else "false"
    lines = [f"{ind}{{", f"{ind}    let ab = {buf} * A_TILE + a_sg;", f"{ind}    let bb = {buf} * B_TILE + b_sg;"]
    for kk in range(c.bk // MATRIX):
        lines.append(f"{ind}    {{")
        body = []
        for i in range(c.tm):
            off = f"ab + {i * MATRIX}u * LDA_S + {kk * MATRIX}u"
            body.append(f"let a{i} = {d.load_a.format(off=off)};")
        for j in range(c.tn):
            if orient == "nt":
                off = f"bb + {j * MATRIX}u * LDB_S + {kk * MATRIX}u"
            else:
                off = f"bb + {kk * MATRIX}u * LDB_S + {j * MATRIX}u"
            body.append(f"let b{j} = {d.load_b.format(off=off, cm=col_major)};")
        for i in range(c.tm):
            for j in range(c.tn):
                mma = d.mma.format(a=f"a{i}", b=f"b{j}", acc=f"acc_{i}_{j}")
                body.append(f"acc_{i}_{j} = {mma};")
        lines += [f"{ind}        {s}" for s in body]
        lines.append(f"{ind}    }}")
    lines.append(f"{ind}}}")
    return lines


def _main_loop(c: TCConfig, orient: str, d: _Dialect) -> list[str]:
    ind = " " * 4
    if not c.prefetch:
        return (
            [f"{ind}for (var r0 = 0u; r0 < prm.R; r0 += BK) {{"]
            + _staging(c, ind * 2, load="r0", store="0u")
            + [f"{ind * 2}workgroupBarrier();"]
            + _compute(c, orient, "0u", ind * 2, d)
            + [f"{ind * 2}workgroupBarrier();", f"{ind}}}"]
        )
    regs = [f"{ind}var ra{e}: vec4<f16>;" for e in range(len(_units(c.bm * c.bk // 4, c.threads)))]
    regs += [f"{ind}var rb{e}: vec4<f16>;" for e in range(len(_units(c.bn * c.bk // 4, c.threads)))]
    return (
        regs
        + [f"{ind}let steps = (prm.R + BK - 1u) / BK;"]
        + _staging(c, ind, load="0u", store="0u")
        + [f"{ind}workgroupBarrier();", f"{ind}for (var t = 0u; t < steps; t++) {{"]
        + [f"{ind * 2}let cur = t & 1u;", f"{ind * 2}let more = t + 1u < steps;", f"{ind * 2}if (more) {{"]
        + _staging(c, ind * 3, load="(t + 1u) * BK", store=None)
        + [f"{ind * 2}}}"]
        + _compute(c, orient, "cur", ind * 2, d)
        + [f"{ind * 2}if (more) {{"]
        + _staging(c, ind * 3, load=None, store="1u - cur")
        + [f"{ind * 2}}}", f"{ind * 2}workgroupBarrier();", f"{ind}}}"]
    )


def matmul_tc_source(v: TCVariant, *, emulate: bool = False) -> str:
    """Full WGSL for one tensor-core matmul variant (emulate=True: the same kernel without subgroup
    matrices, for checking its indexing on adapters without them)."""
    c = v.cfg
    d = _EMU if emulate else _TC
    if c.sg_from_lid and not emulate:
        d = replace(d, sg_param="", sg_let="\n    let sg = lid / 32u;")
    if v.orient not in ("nt", "nn"):
        raise ValueError(f"matmul orientation {v.orient!r}: expected 'nt' or 'nn'")
    if (v.a_type, v.a_vec) not in _A_LOAD:
        raise ValueError(f"TCVariant.a_type={v.a_type!r}: expected 'f32' or 'f16'")
    c.validate(v.orient, max_threads=1 << 16, max_workgroup_bytes=1 << 30)
    a_elem, a_load = _A_LOAD[(v.a_type, v.a_vec)]
    a_load = fill(a_load, H4=d.h4, H2=d.h2)
    out = "C[base + p + c]"
    store_expr = f"{out} = {out} + prm.alpha * v;" if v.accumulate else f"{out} = prm.alpha * v;"
    ind = " " * 4
    acc_decl = "\n".join(f"{ind}var acc_{i}_{j} = {d.result_zero};" for i in range(c.tm) for j in range(c.tn))
    epilogue = []
    for i in range(c.tm):
        for j in range(c.tn):
            epilogue += [
                f"{ind}{d.store_c.format(acc=f'acc_{i}_{j}')};",
                f"{ind}workgroupBarrier();",
                f"{ind}write_out(lid, m0, p0, {i}u, {j}u);",
                f"{ind}workgroupBarrier();",
            ]
    return fill(
        kernel_text("matmul_tc.wgsl"),
        DIRECTIVES=d.directives,
        EMULATION=d.emulation,
        SG_PARAM=d.sg_param,
        SG_LET=d.sg_let,
        DECODE=decode_snippet(v.wtype),
        W_ELEM=WEIGHT_TYPES[v.wtype].w_elem,
        A_ELEM=a_elem,
        A_LOAD=a_load,
        SG_M=c.sg_m,
        TM=c.tm,
        TN=c.tn,
        BM=c.bm,
        BN=c.bn,
        BK=c.bk,
        THREADS=c.threads,
        NSG=c.subgroups,
        LDA_S=c.bk + c.pad,
        LDB_S=c.b_stride(v.orient),
        B_TILE=c.b_tile(v.orient),
        AS_LEN=c.buffers * c.bm * (c.bk + c.pad),
        BS_LEN=c.buffers * c.b_tile(v.orient),
        CS_LEN=c.subgroups * MATRIX * MATRIX,
        LOAD_B=_LOAD_B[v.orient],
        STORE_B_OFFSET=_STORE_B_OFFSET[v.orient],
        B_SG=_B_SG[v.orient],
        STORE_EXPR=store_expr,
        ACC_DECL=acc_decl,
        MAIN_LOOP="\n".join(_main_loop(c, v.orient, d)),
        EPILOGUE="\n".join(epilogue),
    )
