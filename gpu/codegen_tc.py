"""Generate the tensor-core matmul kernels (gpu/kernels/matmul_tc.wgsl) for Dawn's subgroup matrices.

A `TCConfig` fixes the workgroup shape: SG_M x SG_N subgroups of 32 invocations, each owning TM x TN result
matrices of 16 x 16 (f32), BK reduction steps staged per iteration as f16 in workgroup memory in units of
V elements, with 0, 1 or 2 pipeline stages (see matmul_tc.wgsl). A `TCVariant` adds what the kernel binds
and computes: weight type (its decode snippet from gpu/codegen.py), orientation, A's element type and
load width, accumulate. The static WGSL lives in gpu/kernels/matmul_tc*.wgsl; this module generates only
the tile-dependent, fully unrolled parts (staging calls, matrix loads and multiply-accumulates, epilogue),
with one named variable per result matrix (no private arrays of subgroup matrices, which would spill).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu.codegen import MATMUL_PARAMS, WEIGHT_TYPES, decode_snippet, fill, kernel_text

SUBGROUP_SIZE = 32  # invocations per subgroup the kernels are generated for (NVIDIA)
MATRIX = 16  # side of one subgroup matrix (the f16 -> f32 config M16 N16 K16)
PROBES = ("", "no_mma", "no_stage")  # timing probes: drop the MMAs / the staging (bench/tc_sweep.py)


@dataclass(frozen=True)
class SubgroupTile:
    """The subgroup grid of a tensor-core GEMM's workgroup: sg_m x sg_n subgroups, each owning tm x tn result
    matrices of 16 x 16 (TCConfig here, gpu/codegen_i8.py's I8Config)."""

    sg_m: int  # subgroups along M
    sg_n: int  # subgroups along P
    tm: int  # 16 x 16 result matrices per subgroup along M
    tn: int  # ... along P

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

    def check_fit(self, what: str, workgroup_bytes: int, max_threads: int, max_workgroup_bytes: int) -> None:
        """Raise ValueError when the workgroup (named `what` in the message) needs more threads or workgroup
        memory than the device allows."""
        if self.threads > max_threads:
            raise ValueError(f"{what} needs {self.threads} threads; the device allows {max_threads}")
        if workgroup_bytes > max_workgroup_bytes:
            raise ValueError(
                f"{what} needs {workgroup_bytes} B of workgroup memory; the device allows {max_workgroup_bytes}"
            )


@dataclass(frozen=True)
class TCConfig(SubgroupTile):
    """Workgroup tile of the tensor-core GEMM (sizes in elements unless noted)."""

    bk: int = 32  # reduction steps staged per iteration (multiple of 16)
    stages: int = 1  # 0: load+store in place; 1: register prefetch; 2: register prefetch + two buffers
    vec: int = 8  # elements per staging unit (4 or 8)
    pad: int = 8  # f16 padding per staged row (keeps the matrix loads off shared bank conflicts)
    group_m: int = 8  # workgroup rows per raster group (L2 reuse of B), 0: row-major order
    direct: bool = True  # interior tiles store results straight to C (else always through the scratch)
    split: bool = True  # one workgroup array per subgroup row / column block: constant matrix-load offsets
    probe: str = ""  # timing probe (PROBES); "" for real kernels

    @property
    def buffers(self) -> int:
        return 2 if self.stages == 2 else 1

    @property
    def a_blocks(self) -> int:
        """Arrays the A tile is split in (per buffer): one per subgroup row when split."""
        return self.sg_m if self.split else 1

    @property
    def b_blocks(self) -> int:
        return self.sg_n if self.split else 1

    @property
    def a_block(self) -> int:
        """Elements of one A block: [BM / a_blocks][BK + pad]."""
        return self.bm // self.a_blocks * (self.bk + self.pad)

    def b_stride(self, orient: str) -> int:
        """Row stride of a staged B block: [cols][BK] for "nt", [BK][cols] for "nn" (cols = BN / b_blocks)."""
        return self.bk + self.pad if orient == "nt" else self.bn // self.b_blocks + self.pad

    def b_block(self, orient: str) -> int:
        return (self.bn // self.b_blocks if orient == "nt" else self.bk) * self.b_stride(orient)

    def workgroup_bytes(self, orient: str) -> int:
        staged = self.a_blocks * self.a_block + self.b_blocks * self.b_block(orient)
        return 2 * self.buffers * staged + 4 * self.subgroups * MATRIX * MATRIX

    def validate(self, orient: str, max_threads: int = 1024, max_workgroup_bytes: int = 49152) -> None:
        """Raise ValueError when the tile cannot be generated or exceeds the given device limits."""
        for name in ("sg_m", "sg_n", "tm", "tn", "bk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TCConfig.{name}={getattr(self, name)} must be positive")
        if self.bk % MATRIX:
            raise ValueError(f"TCConfig.bk={self.bk} must be a multiple of {MATRIX}")
        if self.vec not in (4, 8):
            raise ValueError(f"TCConfig.vec={self.vec} must be 4 or 8")
        if self.stages not in (0, 1, 2):
            raise ValueError(f"TCConfig.stages={self.stages} must be 0, 1 or 2")
        if self.pad % 8 or self.pad < 0:
            raise ValueError(f"TCConfig.pad={self.pad} must be a non-negative multiple of 8 (16-byte rows)")
        if self.group_m < 0:
            raise ValueError(f"TCConfig.group_m={self.group_m} must be >= 0")
        if self.probe not in PROBES:
            raise ValueError(f"TCConfig.probe={self.probe!r}: expected one of {PROBES}")
        self.check_fit(f"TCConfig {self} ({orient})", self.workgroup_bytes(orient), max_threads, max_workgroup_bytes)

    @property
    def label(self) -> str:
        """Short name: sg_m x sg_n subgroups, tm x tn matrices each, bk, stages, vec (+ options)."""
        s = f"{self.sg_m}x{self.sg_n}_{self.tm}x{self.tn}_k{self.bk}_s{self.stages}_v{self.vec}"
        if self.pad != 8:
            s += f"_p{self.pad}"
        if self.group_m != 8:
            s += f"_g{self.group_m}"
        if not self.direct:
            s += "_cs"
        if not self.split:
            s += "_flat"
        return s + (f"_{self.probe}" if self.probe else "")


@dataclass(frozen=True)
class TCVariant:
    """One compiled tensor-core matmul kernel."""

    wtype: str  # GGML weight type name, e.g. "Q4_K"
    orient: str  # "nt": C = A . W^T (forward); "nn": C = A . W (input gradient)
    cfg: TCConfig
    a_type: str = "f32"  # element type of A in memory: "f32" or "f16"
    a_width: int = 4  # elements per A load (8 f16 only; 4; 1): lda, a_off and A's binding multiples of it
    accumulate: bool = False  # C += alpha * A.B instead of C = alpha * A.B
    w_wide: bool = False  # F16 weight bound as vec4<u32> (K % 8 == 0): 16-byte loads, no f32 round trip
    b_fast: bool = True  # "nn": plain B loaders (weight row length K % vec == 0); else the checked ones
    w_generic: bool = False  # stage the weight through its type's decode4 even where W_STAGING has a loader

    @property
    def key(self) -> tuple:
        return ("matmul_tc", self)


_A_ACCESS = {  # (a_type, a_width) -> (binding element, snippet)
    ("f32", 4): ("vec4<f32>", "matmul_tc_a_f32x4.wgsl"),
    ("f32", 1): ("f32", "matmul_tc_a_f32x1.wgsl"),
    ("f16", 8): ("vec4<u32>", "matmul_tc_a_f16x8.wgsl"),
    ("f16", 4): ("vec2<u32>", "matmul_tc_a_f16x4.wgsl"),
    ("f16", 1): ("u32", "matmul_tc_a_f16x1.wgsl"),
}
# Weight types with a dedicated 8-wide loader (w_vec8 decodes a unit with one header/scale decode and wide
# loads of its quant bytes; the generic one calls decode4 twice): type -> (binding element, snippet, whether
# the snippet builds on the type's decode4, the byte helpers and w_bytes8, or defines its own decode4).
W_STAGING: dict[str, tuple[str, str, bool]] = {
    "Q4_K": ("vec4<u32>", "matmul_tc_w_q4_k.wgsl", False),
    "Q4_0": ("u32", "matmul_tc_w_q4_0.wgsl", True),
    "Q8_0": ("u32", "matmul_tc_w_q8_0.wgsl", True),
    "Q6_K": ("u32", "matmul_tc_w_q6_k.wgsl", True),
}
_LEFT = "subgroup_matrix_left<f16, 16, 16>"
_RIGHT = "subgroup_matrix_right<f16, 16, 16>"
_RESULT = "subgroup_matrix_result<f32, 16, 16>"


@dataclass(frozen=True)
class _Dialect:
    """How the generated code spells the subgroup-matrix operations."""

    sg_param: str
    sg_let: str
    result_zero: str
    load_a: str  # format(blk=..., off=...): left matrix from As[blk], row-major, stride LDA_S
    load_b: str  # format(blk=..., off=..., cm=...): right matrix from Bs[blk], stride LDB_S
    mma: str  # format(a=..., b=..., acc=...)
    store_cs: str  # format(acc=...): result to Cs[sg], row-major, stride 16
    store_c: str  # format(off=..., acc=...): result straight to C, row-major, stride ldc
    load_c: str  # format(off=...): result matrix from C (accumulate)
    h4: str  # vec2<u32> -> vec4<f16> reinterpretation
    h2: str  # u32 -> vec2<f16>


_TC = _Dialect(
    sg_param="\n    @builtin(subgroup_id) sg: u32,",
    sg_let="",
    result_zero=f"{_RESULT}()",
    load_a=f"subgroupMatrixLoad<{_LEFT}>(&As[{{blk}}], {{off}}, false, LDA_S)",
    load_b=f"subgroupMatrixLoad<{_RIGHT}>(&Bs[{{blk}}], {{off}}, {{cm}}, LDB_S)",
    mma="subgroupMatrixMultiplyAccumulate({a}, {b}, {acc})",
    store_cs="subgroupMatrixStore(&Cs[sg], 0u, {acc}, false, 16u)",
    store_c="subgroupMatrixStore(&C, {off}, {acc}, false, prm.ldc)",
    load_c=f"subgroupMatrixLoad<{_RESULT}>(&C, {{off}}, false, prm.ldc)",
    h4="bitcast<vec4<f16>>",
    h2="bitcast<vec2<f16>>",
)
_EMU = _Dialect(
    sg_param="",
    sg_let="\n    let sg = lid / 32u;\n    emu_lane = lid % 32u;",
    result_zero="EmuF()",
    load_a="EmuH({blk}, {off}, 0u, LDA_S)",
    load_b="EmuH({blk}, {off}, u32({cm}), LDB_S)",
    mma="emu_mma({a}, {b}, {acc})",
    store_cs="emu_store_cs(sg, {acc}, 16u)",
    store_c="emu_store_c({off}, {acc}, prm.ldc)",
    load_c="emu_load_c({off}, prm.ldc)",
    h4="emu_h4",
    h2="emu_h2",
)


def _units(total: int, threads: int) -> list[tuple[str, bool]]:
    """(unit index expression, needs a bounds guard) for each of a thread's staging units."""
    n = -(-total // threads)
    return [(f"lid + {e}u * THREADS", (e + 1) * threads > total) for e in range(n)]


def _staging(c: TCConfig, orient: str, ind: str, *, load: str | None, store: str | None, edge: bool, b_fast: bool):
    """Staging lines: loads into registers ra*/rb* (store None), stores from them (load None), or both
    (load=r0 expression, store=buffer expression). All loads of a step come before any of its stores."""
    loads, stores = [], []
    b_loader = f"ld_b_{orient}" + ("_edge" if edge or not b_fast else "")
    for tile, total, origin, loader in (
        ("a", c.bm * c.bk // c.vec, "m0", "ld_a" + ("_edge" if edge else "")),
        ("b", c.bn * c.bk // c.vec, "p0", b_loader),
    ):
        for e, (u, guard) in enumerate(_units(total, c.threads)):
            reg = f"r{tile}{e}"
            pairs = []
            if load is not None:
                pairs.append((loads, f"{reg} = {loader}({u}, {origin}, {load});"))
            if store is not None:
                put = "put_a" if tile == "a" else f"put_b_{orient}"
                pairs.append((stores, f"{put}({u}, {store}, {reg});"))
            for out, stmt in pairs:
                out.append(f"{ind}if ({u} < {total}u) {{ {stmt} }}" if guard else ind + stmt)
    return loads + stores


def _registers(c: TCConfig, ind: str) -> list[str]:
    n_a = len(_units(c.bm * c.bk // c.vec, c.threads))
    n_b = len(_units(c.bn * c.bk // c.vec, c.threads))
    return [f"{ind}var ra{e}: U;" for e in range(n_a)] + [f"{ind}var rb{e}: U;" for e in range(n_b)]


def _offset(base: str, value: int) -> str:
    """An offset expression: a literal when there is no run-time base (split tiles)."""
    return f"{value}u" if not base else f"{base} + {value}u"


def _compute(c: TCConfig, orient: str, buf: str, ind: str, d: _Dialect) -> list[str]:
    """One staged tile's worth of matrix loads and multiply-accumulates for this subgroup. Split tiles
    address a subgroup's block by array index and its matrices by literal offsets."""
    col_major = "true" if orient == "nt" else "false"
    a_blk = f"{buf} * A_NB" + (" + sg_m" if c.split else "")
    b_blk = f"{buf} * B_NB" + (" + sg_n" if c.split else "")
    a_base, b_base = ("", "") if c.split else ("a_sg", "b_sg")
    lines = [f"{ind}{{", f"{ind}    let ablk = {a_blk};", f"{ind}    let bblk = {b_blk};"]
    ksteps, tm, tn = (1, 1, 1) if c.probe == "no_mma" else (c.bk // MATRIX, c.tm, c.tn)
    lda, ldb = c.bk + c.pad, c.b_stride(orient)
    for kk in range(ksteps):
        body = [
            f"let a{i} = {d.load_a.format(blk='ablk', off=_offset(a_base, i * MATRIX * lda + kk * MATRIX))};"
            for i in range(tm)
        ]
        for j in range(tn):
            rel = j * MATRIX * ldb + kk * MATRIX if orient == "nt" else kk * MATRIX * ldb + j * MATRIX
            body.append(f"let b{j} = {d.load_b.format(blk='bblk', off=_offset(b_base, rel), cm=col_major)};")
            body += [f"acc_{i}_{j} = {d.mma.format(a=f'a{i}', b=f'b{j}', acc=f'acc_{i}_{j}')};" for i in range(tm)]
        lines += [f"{ind}    {{"] + [f"{ind}        {s}" for s in body] + [f"{ind}    }}"]
    lines.append(f"{ind}}}")
    return lines


def _main_loop(c: TCConfig, orient: str, d: _Dialect, b_fast: bool) -> list[str]:
    """The reduction loop: `full` steps with the plain loaders, then a checked tail step if R % BK != 0."""
    i1, i2, i3 = " " * 4, " " * 8, " " * 12

    def stage(ind: str, r0: str, **kw: str | None) -> list[str]:
        fast = _staging(c, orient, ind + "    ", edge=False, b_fast=b_fast, load=r0, **kw)
        edge = _staging(c, orient, ind + "    ", edge=True, b_fast=b_fast, load=r0, **kw)
        step = "t" if r0 in ("r0", "0u") else "(t + 1u)"
        return [f"{ind}if ({step} < full) {{"] + fast + [f"{ind}}} else {{"] + edge + [f"{ind}}}"]

    def stores(ind: str, buf: str) -> list[str]:
        return _staging(c, orient, ind, edge=False, b_fast=b_fast, load=None, store=buf)

    staged = "t == 0u" if c.probe == "no_stage" else "true"
    if c.stages == 0:
        return (
            [f"{i1}for (var t = 0u; t < steps; t++) {{", f"{i2}let r0 = t * BK;", f"{i2}if ({staged}) {{"]
            + _registers(c, i3)
            + stage(i3, "r0", store="0u")
            + [f"{i2}}}", f"{i2}workgroupBarrier();"]
            + _compute(c, orient, "0u", i2, d)
            + [f"{i2}workgroupBarrier();", f"{i1}}}"]
        )
    nxt = "t + 1u < steps" if c.probe != "no_stage" else "false"
    first = [f"{i1}let t = 0u;"]
    if c.stages == 1:
        return (
            _registers(c, i1)
            + [f"{i1}{{"]
            + [f"    {s}" for s in first + stage(i1, "0u", store=None)]
            + [f"{i1}}}", f"{i1}for (var t = 0u; t < steps; t++) {{", f"{i2}if ({staged}) {{"]
            + stores(i3, "0u")
            + [f"{i2}}}", f"{i2}workgroupBarrier();", f"{i2}if ({nxt}) {{"]
            + stage(i3, "(t + 1u) * BK", store=None)
            + [f"{i2}}}"]
            + _compute(c, orient, "0u", i2, d)
            + [f"{i2}workgroupBarrier();", f"{i1}}}"]
        )
    return (
        _registers(c, i1)
        + [f"{i1}{{"]
        + [f"    {s}" for s in first + stage(i1, "0u", store=None) + stores(i1, "0u")]
        + [f"{i1}}}", f"{i1}workgroupBarrier();", f"{i1}for (var t = 0u; t < steps; t++) {{"]
        + [f"{i2}let cur = t & 1u;", f"{i2}if ({nxt}) {{"]
        + stage(i3, "(t + 1u) * BK", store=None)
        + [f"{i2}}}"]
        + _compute(c, orient, "cur", i2, d)
        + [f"{i2}if ({nxt}) {{"]
        + stores(i3, "1u - cur")
        + [f"{i2}}}", f"{i2}workgroupBarrier();", f"{i1}}}"]
    )


def _sg_offsets(c: TCConfig, orient: str) -> str:
    """Flat tiles: the run-time offsets of this subgroup's rows of A and columns of B in their arrays."""
    if c.split:
        return ""
    b_sg = "sg_n * (TN * 16u) * LDB_S" if orient == "nt" else "sg_n * (TN * 16u)"
    return f"    let a_sg = sg_m * (TM * 16u) * LDA_S;\n    let b_sg = {b_sg};"


def _c_offset(i: int, j: int) -> str:
    return f"c_sg + {i * MATRIX}u * prm.ldc + {j * MATRIX}u"


def _acc_decl(c: TCConfig, d: _Dialect, accumulate: bool) -> list[str]:
    ind = " " * 4
    pairs = [(i, j) for i in range(c.tm) for j in range(c.tn)]
    lines = [f"{ind}var acc_{i}_{j} = {d.result_zero};" for i, j in pairs]
    if accumulate and c.direct:  # direct epilogue: start from C itself (alpha = 1)
        loads = [f"{ind}    acc_{i}_{j} = {d.load_c.format(off=_c_offset(i, j))};" for i, j in pairs]
        lines += [f"{ind}if (direct) {{"] + loads + [f"{ind}}}"]
    return lines


def _epilogue(c: TCConfig, d: _Dialect) -> list[str]:
    """Direct stores (emitted only when c.direct: Dawn then requires C's binding to hold one matrix), else
    the checked path through the scratch."""
    ind = " " * 4
    pairs = [(i, j) for i in range(c.tm) for j in range(c.tn)]
    lines = [f"{ind}if (direct) {{"]
    if c.direct:
        lines += [f"{ind}    {d.store_c.format(off=_c_offset(i, j), acc=f'acc_{i}_{j}')};" for i, j in pairs]
    lines.append(f"{ind}}} else {{")
    for i, j in pairs:
        lines += [
            f"{ind}    {d.store_cs.format(acc=f'acc_{i}_{j}')};",
            f"{ind}    workgroupBarrier();",
            f"{ind}    write_out(lid, m0, p0, {i}u, {j}u);",
            f"{ind}    workgroupBarrier();",
        ]
    return lines + [f"{ind}}}"]


def weight_loader(wtype: str, *, wide: bool = False, generic: bool = False, emulate: bool = False) -> tuple[str, str]:
    """(W's binding element, WGSL defining `w_vec8(n, k, K) -> H8` = W[n, k..k+7] as f16) for a weight type: the
    8-wide F16 loader (wide), the type's dedicated loader (W_STAGING, unless generic), else two calls of its
    decode4; its f16 reinterpretations those of the emulation (emulate) or of Tint. The GEMM's staging and
    gpu/kernels/weight_f16.wgsl share it, so both round alike."""
    if wide:
        w_elem, text = "vec4<u32>", kernel_text("matmul_tc_w_f16x8.wgsl")
    elif wtype in W_STAGING and not generic:
        w_elem, snippet, with_decode = W_STAGING[wtype]
        helpers = decode_snippet(wtype) + "\n" + kernel_text("matmul_tc_w_bytes8.wgsl") + "\n"
        text = (helpers if with_decode else "") + kernel_text(snippet)
    else:
        w_elem = WEIGHT_TYPES[wtype].w_elem
        text = decode_snippet(wtype) + "\n" + kernel_text("matmul_tc_w_generic.wgsl")
    return w_elem, fill(text, H4=(_EMU if emulate else _TC).h4)


def matmul_tc_source(v: TCVariant, *, emulate: bool = False) -> str:
    """Full WGSL for one tensor-core matmul variant (emulate=True: the same kernel without subgroup
    matrices, for checking its indexing on adapters without them)."""
    c = v.cfg
    d = _EMU if emulate else _TC
    if v.orient not in ("nt", "nn"):
        raise ValueError(f"matmul orientation {v.orient!r}: expected 'nt' or 'nn'")
    if (v.a_type, v.a_width) not in _A_ACCESS:
        raise ValueError(f"TCVariant a_type={v.a_type!r}, a_width={v.a_width}: expected one of {sorted(_A_ACCESS)}")
    if v.w_wide and v.wtype != "F16":
        raise ValueError(f"TCVariant.w_wide applies to F16 weights, not {v.wtype}")
    c.validate(v.orient, max_threads=1 << 16, max_workgroup_bytes=1 << 30)
    a_elem, a_file = _A_ACCESS[(v.a_type, v.a_width)]
    w_elem, decode = weight_loader(v.wtype, wide=v.w_wide, generic=v.w_generic, emulate=emulate)
    out = "C[base + p + c]"
    store_expr = f"{out} = {out} + prm.alpha * v;" if v.accumulate else f"{out} = prm.alpha * v;"
    return fill(
        kernel_text("matmul_tc.wgsl"),
        DIRECTIVES="enable f16;" if emulate else kernel_text("matmul_tc_directives.wgsl"),
        EMULATION=kernel_text("matmul_tc_emulation.wgsl") if emulate else "",
        SG_PARAM=d.sg_param,
        SG_LET=d.sg_let,
        DECODE=decode,
        PARAMS=kernel_text(MATMUL_PARAMS),
        W_ELEM=w_elem,
        A_ELEM=a_elem,
        A_ACCESS=fill(kernel_text(a_file), H4=d.h4, H2=d.h2),
        STAGING_FNS=kernel_text(f"matmul_tc_stage_v{c.vec}.wgsl"),
        SG_M=c.sg_m,
        TM=c.tm,
        TN=c.tn,
        BM=c.bm,
        BN=c.bn,
        BK=c.bk,
        V=c.vec,
        THREADS=c.threads,
        NSG=c.subgroups,
        GROUP_M=c.group_m,
        RASTER=kernel_text("matmul_raster.wgsl"),
        A_NB=c.a_blocks,
        B_NB=c.b_blocks,
        LDA_S=c.bk + c.pad,
        LDB_S=c.b_stride(v.orient),
        BU_ROW=(c.bk if v.orient == "nt" else c.bn) // c.vec,
        A_BLK=c.a_block,
        B_BLK=c.b_block(v.orient),
        A_BLOCKS=c.buffers * c.a_blocks,
        B_BLOCKS=c.buffers * c.b_blocks,
        SG_OFFSETS=_sg_offsets(c, v.orient),
        DIRECT="true" if c.direct else "false",
        STORE_EXPR=store_expr,
        ACC_DECL="\n".join(_acc_decl(c, d, v.accumulate)),
        MAIN_LOOP="\n".join(_main_loop(c, v.orient, d, v.b_fast)),
        EPILOGUE="\n".join(_epilogue(c, d)),
    )
