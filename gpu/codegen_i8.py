"""Generate the integer tensor-core GEMM (gpu/kernels/matmul_i8.wgsl) for Dawn's i8 subgroup matrices (16 x 16 x 32).

An `I8Config` fixes the workgroup: SG_M x SG_N subgroups of 32 invocations, each owning TM x TN i32 result
matrices, BK codes per row staged per step, FM result matrices scaled per pass through the scratch. An
`I8Variant` adds whether K is cut in chunks with their own scales (the scaling then runs at every chunk's end,
into f32 registers) or has one scale per row (only at the end), and whether C accumulates. The static WGSL
lives in the template; this module generates the fully unrolled parts, one named variable per result matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu.codegen import fill, kernel_text
from gpu.codegen_tc import MATRIX, SubgroupTile

MMA_K = 32  # codes per multiply-accumulate (the 16 x 16 x 32 i8 config)
# timing probes (bench/gemm_i8.py; "" for real kernels): without the MMAs, the staging after the first step, the
# per-chunk scaling, the epilogue's barriers (results wrong across subgroups), or the epilogue's stores to C; or
# "direct": no staging at all, each subgroup loading its matrices straight from storage (results right when M and
# N are multiples of the tile; no rows are clamped); with a LoRA term, its epilogue without each block's product
# (the operands still loaded up front: "no_lora_block"; the values it adds then whatever the scratch holds)
PROBES = ("", "no_mma", "no_stage", "no_scale", "no_ebar", "no_write", "direct", "no_lora_block")
LORA_PROBES = ("no_lora_block",)


@dataclass(frozen=True)
class I8Config(SubgroupTile):
    """Workgroup tile of the integer GEMM (sizes in elements unless noted)."""

    bk: int = 64  # codes per row staged per step (multiple of 32)
    fm: int = 2  # result matrices per subgroup scaled per pass (divides tm * tn)
    pad: int = 4  # words of padding per staged row
    stages: int = 1  # 1: register prefetch, one buffer; 2: register prefetch, two buffers (one barrier a step)
    group_m: int = 8  # workgroup rows per raster group (L2 reuse), 0: row-major
    # an accumulating epilogue reads the C values it adds onto this many scaling groups ahead (0: as it writes each
    # one, a read-modify-write whose latency every group waits out)
    old_ahead: int = 2
    # the scaling scratch Cs in the staging buffers (free between a step's last barrier and the next step's stores;
    # one buffer only): 8 KB (16 subgroups: 16 KB) less workgroup memory, for tiles that do not fit beside it
    cs_in_stage: bool = False
    probe: str = ""

    @property
    def ldw(self) -> int:
        """Staged row stride in words."""
        return self.bk // 4 + self.pad

    def workgroup_bytes(self, lora: bool = False) -> int:
        """Staging buffers and the epilogue's scratch (twice with a LoRA term: its f32 blocks beside Cs)."""
        scratch = self.subgroups * self.fm * MATRIX * MATRIX * ((0 if self.cs_in_stage else 1) + (1 if lora else 0))
        return 4 * (self.stages * (self.bm + self.bn) * self.ldw + scratch)

    def cs_home(self) -> tuple[str, int]:
        """Where Cs lives with cs_in_stage: the staging array (As or Bs) and how many subgroups' scratch each of
        its blocks holds."""
        cs_len = self.fm * MATRIX * MATRIX
        for name, rows, blocks in (("As", self.bm // self.sg_m, self.sg_m), ("Bs", self.bn // self.sg_n, self.sg_n)):
            per = rows * self.ldw // cs_len
            if per * blocks >= self.subgroups:
                return name, per
        raise ValueError(f"I8Config {self.label}: cs_in_stage, but neither staging buffer holds "
                         f"{self.subgroups} x {cs_len} words of scratch")  # fmt: skip

    def validate(self, max_threads: int = 1024, max_workgroup_bytes: int = 49152, lora: bool = False) -> None:
        """Raise ValueError when the tile cannot be generated or exceeds the given device limits."""
        for name in ("sg_m", "sg_n", "tm", "tn", "bk", "fm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"I8Config.{name}={getattr(self, name)} must be positive")
        if self.bk % MMA_K:
            raise ValueError(f"I8Config.bk={self.bk} must be a multiple of {MMA_K}")
        if self.pad % 4 or self.pad < 0:
            raise ValueError(f"I8Config.pad={self.pad} must be a non-negative multiple of 4 words (16-byte rows)")
        if self.old_ahead < 0:
            raise ValueError(f"I8Config.old_ahead={self.old_ahead} must be >= 0")
        if self.stages not in (1, 2):
            raise ValueError(f"I8Config.stages={self.stages} must be 1 or 2")
        if self.cs_in_stage:
            if self.stages != 1:
                raise ValueError(f"I8Config.cs_in_stage needs stages=1 (got {self.stages}): two buffers are never free")
            self.cs_home()
        if (self.tm * self.tn) % self.fm:
            raise ValueError(f"I8Config.fm={self.fm} must divide tm * tn = {self.tm * self.tn}")
        if self.probe not in PROBES:
            raise ValueError(f"I8Config.probe={self.probe!r}: expected one of {PROBES}")
        self.check_fit(f"I8Config {self.label}", self.workgroup_bytes(lora), max_threads, max_workgroup_bytes)

    @property
    def label(self) -> str:
        s = f"{self.sg_m}x{self.sg_n}_{self.tm}x{self.tn}_k{self.bk}_f{self.fm}"
        if self.pad != 4:
            s += f"_p{self.pad}"
        if self.stages != 1:
            s += f"_s{self.stages}"
        if self.group_m != 8:
            s += f"_g{self.group_m}"
        if self.old_ahead != 2:
            s += f"_o{self.old_ahead}"
        if self.cs_in_stage:
            s += "_cs"
        return s + (f"_{self.probe}" if self.probe else "")


@dataclass(frozen=True)
class I8Variant:
    """One compiled integer GEMM kernel."""

    cfg: I8Config
    chunked: bool  # K in several chunks, each with its own scales (else one scale per row)
    accumulate: bool = False  # C += alpha * (...) instead of C = alpha * (...)
    orient: str = "nt"  # "nt": C = A . W^T (forward); "nn": C = A . W (input gradient; one chunk)
    # C also gets s T . L ("nt", one chunk; T [M, r]): L = LB^T with LB [N, r] ("rows": the forward's t = x A^T
    # and B), or L [r, N] ("cols": the input gradient's dt = s dY B and A)
    lora: str = ""
    residual: bool = False  # C = R + alpha * (...) with R [M, N] bound beside C, read like an accumulating C

    @property
    def key(self) -> tuple:
        return ("matmul_i8", self)

    @property
    def adds_old(self) -> bool:
        """Whether each value is added onto one read as it is written (C's own, or R's)."""
        return self.accumulate or self.residual


@dataclass(frozen=True)
class _Dialect:
    """How the generated code spells the subgroup-matrix operations."""

    directives: str
    sg_param: str
    sg_let: str
    zero: str
    load_a: str  # format(off=...)
    load_b: str
    mma: str  # format(a=..., b=..., acc=...)
    store_cs: str  # format(off=..., acc=..., arr=..., base=...): arr[base off ..] is the scratch (_cs_scratch)


_TC = _Dialect(
    directives="diagnostic(off, chromium.subgroup_matrix_uniformity);\nenable subgroups;\n"
    "enable chromium_experimental_subgroup_matrix;",
    sg_param="\n    @builtin(subgroup_id) sg: u32,\n    @builtin(subgroup_invocation_id) lane: u32,",
    sg_let="",
    zero="subgroup_matrix_result<i32, 16, 16>()",
    load_a="subgroupMatrixLoad<subgroup_matrix_left<i8, 32, 16>>(&As[ablk], {off}, false, LDW * 4u)",
    load_b="subgroupMatrixLoad<subgroup_matrix_right<i8, 16, 32>>(&Bs[bblk], {off}, {cm}, {stride})",
    mma="subgroupMatrixMultiplyAccumulate({a}, {b}, {acc})",
    store_cs="subgroupMatrixStore(&{arr}, {base}{off}, {acc}, false, 16u)",
)
_EMU = _Dialect(
    directives="",
    sg_param="",
    sg_let="\n    let sg = lid / 32u;\n    let lane = lid % 32u;\n    emu_lane = lane;",
    zero="EmuI()",
    load_a="EmuOp(ablk, {off}, 0u, LDW * 4u)",
    load_b="EmuOp(bblk, {off}, u32({cm}), {stride})",
    mma="emu_mma({a}, {b}, {acc})",
    store_cs="emu_store_cs(sg, {off}, {acc})",
)


def _units(total: int, threads: int) -> list[tuple[str, bool]]:
    """(unit index expression, needs a bounds guard) for each of a thread's staging units."""
    return [(f"lid + {e}u * THREADS", (e + 1) * threads > total) for e in range(-(-total // threads))]


def _b_unit_bytes(orient: str) -> int:
    """Bytes of W per staging unit: a vec4 of one row ("nt"), or 4 rows x 16 columns ("nn", transposed)."""
    return 16 if orient == "nt" else 64


def _staging(c: I8Config, orient: str, ind: str, step: str | None, buf: str = "0u") -> list[str]:
    """Loads of `step` into the registers (step given), or the stores of the registers into buffer `buf`."""
    out = []
    for tile, total, origin in (("a", c.bm * c.bk // 16, "m0"), ("b", c.bn * c.bk // _b_unit_bytes(orient), "n0")):
        for e, (u, guard) in enumerate(_units(total, c.threads)):
            stmt = f"r{tile}{e} = ld_{tile}({u}, {origin}, {step});" if step else f"put_{tile}({u}, r{tile}{e}, {buf});"
            out.append(f"{ind}if ({u} < {total}u) {{ {stmt} }}" if guard else ind + stmt)
    return out


def _cs_scratch(c: I8Config) -> tuple[str, str]:
    """This subgroup's scratch Cs as (array expression, its first word as a prefix to an offset): its own array, or
    a block of a staging buffer (cs_in_stage)."""
    if not c.cs_in_stage:
        return "Cs[sg]", ""
    name, per = c.cs_home()
    return f"{name}[sg / {per}u]", f"(sg % {per}u) * {c.fm * MATRIX * MATRIX}u + "


def _pairs(c: I8Config) -> list[tuple[int, int]]:
    return [(i, j) for i in range(c.tm) for j in range(c.tn)]


def _decls(c: I8Config, v: I8Variant, d: _Dialect) -> list[str]:
    ind = " " * 4
    lines = [f"{ind}var acc_{i}_{j} = {d.zero};" for i, j in _pairs(c)]
    if v.chunked:
        lines += [f"{ind}var f_{i}_{j}: array<f32, 8>;" for i, j in _pairs(c)]
    if c.probe == "direct":
        return lines
    n_a = len(_units(c.bm * c.bk // 16, c.threads))
    n_b = len(_units(c.bn * c.bk // _b_unit_bytes(v.orient), c.threads))
    b_type = "vec4<u32>" if v.orient == "nt" else "array<vec4<u32>, 4>"
    return (
        lines + [f"{ind}var ra{e}: vec4<u32>;" for e in range(n_a)] + [f"{ind}var rb{e}: {b_type};" for e in range(n_b)]
    )


def _compute(c: I8Config, ind: str, d: _Dialect, buf: str) -> list[str]:
    """One staged step's matrix loads and multiply-accumulates for this subgroup from buffer `buf` (offsets in
    codes): B's columns as column-major matrices, K codes of each column contiguous (both orientations)."""
    lds = 4 * c.ldw
    lines = [f"{ind}let ablk = {buf} * SG_M + sg_m;", f"{ind}let bblk = {buf} * SG_N + sg_n;"]
    ksteps = 1 if c.probe == "no_mma" else c.bk // MMA_K
    tm, tn = (1, 1) if c.probe == "no_mma" else (c.tm, c.tn)
    for kk in range(ksteps):
        body = [f"let a{i} = {d.load_a.format(off=f'{i * MATRIX * lds + kk * MMA_K}u')};" for i in range(tm)]
        for j in range(tn):
            b = d.load_b.format(off=f"{j * MATRIX * lds + kk * MMA_K}u", cm="true", stride="LDW * 4u")
            body.append(f"let b{j} = {b};")
            body += [f"acc_{i}_{j} = {d.mma.format(a=f'a{i}', b=f'b{j}', acc=f'acc_{i}_{j}')};" for i in range(tm)]
        lines += [f"{ind}{{"] + [f"{ind}    {s}" for s in body] + [f"{ind}}}"]
    return lines


def _compute_direct(c: I8Config, ind: str) -> list[str]:
    """Step t's matrix loads (straight from storage, offsets in codes) and multiply-accumulates: the "direct"
    probe's main loop body."""
    lines = []
    for kk in range(c.bk // MMA_K):
        body = []
        for i in range(c.tm):
            off = f"a_base + {i * MATRIX}u * lda_c + t * BK + {kk * MMA_K}u"
            body.append(f"let a{i} = subgroupMatrixLoad<subgroup_matrix_left<i8, 32, 16>>(&A, {off}, false, lda_c);")
        for j in range(c.tn):
            off = f"w_base + {j * MATRIX}u * ldw_c + t * BK + {kk * MMA_K}u"
            body.append(f"let b{j} = subgroupMatrixLoad<subgroup_matrix_right<i8, 16, 32>>(&W, {off}, true, ldw_c);")
            body += [f"acc_{i}_{j} = subgroupMatrixMultiplyAccumulate(a{i}, b{j}, acc_{i}_{j});" for i in range(c.tm)]
        lines += [f"{ind}{{"] + [f"{ind}    {s}" for s in body] + [f"{ind}}}"]
    return lines


def _scale_pass(c: I8Config, v: I8Variant, d: _Dialect, ind: str, chunk: str, final: bool) -> list[str]:
    """Scale every result matrix of this subgroup by SA * SW of `chunk`, FM at a time through Cs: into the f32
    registers (final False) or, with them, out to C (final True)."""
    i2 = ind + "    "
    lines = [f"{ind}{{", f"{i2}let c = {chunk};"]
    lines += [f"{i2}let sa{i} = sa8(ms + {i * MATRIX}u, c);" for i in range(c.tm)]
    lines += [f"{i2}let sw{j} = SW[min(ns + {j * MATRIX}u, prm.N - 1u) * prm.chunks + c];" for j in range(c.tn)]
    pairs = _pairs(c)
    emulated = d is _EMU
    if final and v.lora and not emulated:
        lines += _lora_operands(c, v.lora, i2)
    groups = [pairs[g : g + c.fm] for g in range(0, len(pairs), c.fm)]
    ahead = c.old_ahead if final and v.adds_old else 0
    arr, base = _cs_scratch(c)

    def old_reads(g: int) -> list[str]:  # group g's C values, into old{g}_{f}
        if not ahead or g >= len(groups):
            return []
        reads = enumerate(groups[g])
        return [f"{i2}let old{g}_{f} = old8(ms + {i * MATRIX}u, ns + {j * MATRIX}u);" for f, (i, j) in reads]

    for g in range(ahead):
        lines += old_reads(g)
    for gi, group in enumerate(groups):
        lines += old_reads(gi + ahead)
        stores = [
            d.store_cs.format(off=f"{f * 256}u", acc=f"acc_{i}_{j}", arr=arr, base=base)
            for f, (i, j) in enumerate(group)
        ]
        lines += [f"{i2}{st};" for st in stores]
        if final and v.lora and c.probe not in LORA_PROBES:  # each block's LoRA term beside it (blocks past M or N
            # are never written)
            for f, (i, j) in enumerate(group):
                if emulated:
                    mb, nb = f"ms - row + {i * MATRIX}u", f"ns - col + {j * MATRIX}u"
                    call = f"if ({mb} < prm.M && {nb} < prm.N) {{ lora_block(sg, {f}u, {mb}, {nb}, lane); }}"
                else:
                    call = f"lora_block(sg, {f}u, lmb{i}, lnb{j}, lt{i}, ll{j});"
                lines.append(i2 + call)
        barrier = [] if final and c.probe == "no_ebar" else [f"{i2}workgroupBarrier();"]
        lines += barrier
        for f, (i, j) in enumerate(group):
            part = f"scaled8(sg, {f}u, lane, sa{i}, sw{j})"
            if not final:
                lines.append(f"{i2}f_{i}_{j} = add8(f_{i}_{j}, {part});")
            else:
                val = f"add8(f_{i}_{j}, {part})" if v.chunked else part
                lo = f", lora8(sg, {f}u, lane)" if v.lora else ""
                lo += f", old{gi}_{f}" if ahead else ""
                lines.append(f"{i2}write8(ms + {i * MATRIX}u, ns + {j * MATRIX}u, {val}{lo});")
        lines += barrier
    if not final:
        lines += [f"{i2}acc_{i}_{j} = {d.zero};" for i, j in pairs]
    return lines + [f"{ind}}}"]


def _main_loop(c: I8Config, v: I8Variant, d: _Dialect) -> list[str]:
    i1, i2, i3 = " " * 4, " " * 8, " " * 12
    staged = "t == 0u" if c.probe == "no_stage" else "true"
    nxt = "false" if c.probe == "no_stage" else "t + 1u < steps"
    o = v.orient
    if c.probe == "direct":
        lines = [f"{i1}let lda_c = prm.lda * 16u;", f"{i1}let ldw_c = prm.ldw * 16u;"]
        lines += [f"{i1}let a_base = prm.a_off * 16u + (m0 + sg_m * TM * 16u) * lda_c;"]
        lines += [f"{i1}let w_base = (n0 + sg_n * TN * 16u) * ldw_c;"]
        lines += [f"{i1}for (var t = 0u; t < steps; t++) {{"] + _compute_direct(c, i2)
    elif c.stages == 1:
        lines = _staging(c, o, i1, "0u")
        lines += [f"{i1}for (var t = 0u; t < steps; t++) {{", f"{i2}if ({staged}) {{"]
        lines += _staging(c, o, i3, None)
        lines += [f"{i2}}}", f"{i2}workgroupBarrier();", f"{i2}if ({nxt}) {{"]
        lines += _staging(c, o, i3, "t + 1u")
        lines += [f"{i2}}}", f"{i2}{{"] + _compute(c, i3, d, "0u") + [f"{i2}}}", f"{i2}workgroupBarrier();"]
    else:
        lines = _staging(c, o, i1, "0u") + _staging(c, o, i1, None, "0u") + [f"{i1}workgroupBarrier();"]
        lines += [f"{i1}for (var t = 0u; t < steps; t++) {{", f"{i2}let cur = t & 1u;", f"{i2}if ({nxt}) {{"]
        lines += _staging(c, o, i3, "t + 1u")
        lines += [f"{i2}}}", f"{i2}{{"] + _compute(c, i3, d, "cur") + [f"{i2}}}", f"{i2}if ({nxt}) {{"]
        lines += _staging(c, o, i3, None, "1u - cur")
        lines += [f"{i2}}}", f"{i2}workgroupBarrier();"]
    if v.chunked and c.probe != "no_scale":
        lines.append(f"{i2}if ((t + 1u) % prm.spc == 0u && t + 1u < steps) {{")
        lines += _scale_pass(c, v, d, i3, "t / prm.spc", final=False)
        lines.append(f"{i2}}}")
    return lines + [f"{i1}}}"]


# the LoRA variants' right matrix of L16 for ranks q .. q + 15 of columns nb .. nb + 15: (offset, col_major, stride)
# of the subgroup-matrix load, and L's element (rank k, column nb + col) for the emulation (matmul_i8_lora.wgsl)
_L16 = {
    "rows": ("{nb} * prm.lr + {q}", "true", "prm.lr", "(nb + col) * prm.lr + k"),
    "cols": ("{q} * prm.N + {nb}", "false", "prm.N", "k * prm.N + nb + col"),
}


_T16_LEFT = "subgroup_matrix_left<f16, 16, 16>"
_L16_RIGHT = "subgroup_matrix_right<f16, 16, 16>"


def _l16_load(layout: str, q: str, nb: str) -> str:
    off, cm, stride, _ = _L16[layout]
    return f"subgroupMatrixLoad<{_L16_RIGHT}>(&L16, {off.format(q=q, nb=nb)}, {cm}, {stride})"


def _lora_block(layout: str, emulate: bool) -> str:
    """lora_block (matmul_i8_lora.wgsl) for one layout of L16: per element (emulated), or on subgroup matrices from
    the first 16 ranks' operands the epilogue loaded up front (t0, l0), the rest (ranks past 16) loaded here."""
    if emulate:
        elem = _L16[layout][3]
        return f"""fn lora_block(sg: u32, f: u32, mb: u32, nb: u32, lane: u32) {{
    for (var e = 0u; e < 8u; e++) {{
        let row = (lane * 8u + e) / 16u;
        let col = (lane * 8u + e) % 16u;
        var s = 0.0;
        for (var k = 0u; k < prm.lr; k++) {{
            s += f32(T16[(mb + row) * prm.lr + k]) * f32(L16[{elem}]);
        }}
        Ls[sg][f * 256u + lane * 8u + e] = s;
    }}
}}"""
    return f"""fn lora_block(sg: u32, f: u32, mb: u32, nb: u32, t0: {_T16_LEFT}, l0: {_L16_RIGHT}) {{
    var l = subgroupMatrixMultiplyAccumulate(t0, l0, subgroup_matrix_result<f32, 16, 16>());
    for (var q = 16u; q < prm.lr; q += 16u) {{
        let tq = subgroupMatrixLoad<{_T16_LEFT}>(&T16, mb * prm.lr + q, false, prm.lr);
        l = subgroupMatrixMultiplyAccumulate(tq, {_l16_load(layout, "q", "nb")}, l);
    }}
    subgroupMatrixStore(&Ls[sg], f * 256u, l, false, 16u);
}}"""


def _lora_operands(c: I8Config, layout: str, ind: str) -> list[str]:
    """The epilogue's LoRA operands of the first 16 ranks, loaded once up front (storage loads of subgroup matrices
    are slow: one latency instead of one per block): this subgroup's TM left blocks of T16 and TN right blocks of
    L16, at blocks clamped inside M and N (a clamped block's term is never written)."""
    lines = []
    for i in range(c.tm):
        lines.append(f"{ind}let lmb{i} = min(ms - row + {i * MATRIX}u, prm.M - 16u);")
        lines.append(f"{ind}let lt{i} = subgroupMatrixLoad<{_T16_LEFT}>(&T16, lmb{i} * prm.lr, false, prm.lr);")
    for j in range(c.tn):
        lines.append(f"{ind}let lnb{j} = min(ns - col + {j * MATRIX}u, prm.N - 16u);")
        lines.append(f"{ind}let ll{j} = {_l16_load(layout, '0u', f'lnb{j}')};")
    return lines


def _row_staging(op: str) -> str:
    """ld_<op> / put_<op> of a row-major operand: A (op "a"), or W as B = W^T ("b", the "nt" orientation)."""
    a = op == "a"
    return fill(
        kernel_text("matmul_i8_rows.wgsl"), op=op, OP="A" if a else "W", OP_S="As" if a else "Bs",
        OP_ROWS="M" if a else "N", OP_LD="lda" if a else "ldw", OP_OFF="prm.a_off + " if a else "",
        OP_RB="A_RB" if a else "B_RB", OP_SG="SG_M" if a else "SG_N",
    )  # fmt: skip


def _stage_decls(c: I8Config) -> str:
    """The workgroup buffers the operands are staged in."""
    return fill(
        _STAGE_DECLS, A_BLK=c.bm // c.sg_m * c.ldw, B_BLK=c.bn // c.sg_n * c.ldw, A_BLOCKS=c.stages * c.sg_m,
        B_BLOCKS=c.stages * c.sg_n,
    )  # fmt: skip


_STAGE_DECLS = """var<workgroup> As: array<array<i32, ${A_BLK}>, ${A_BLOCKS}>;   // [buffer * SG_M + subgroup row]
var<workgroup> Bs: array<array<i32, ${B_BLK}>, ${B_BLOCKS}>;   // [buffer * SG_N + subgroup column block]"""


def matmul_i8_source(v: I8Variant, *, emulate: bool = False) -> str:
    """Full WGSL of one integer GEMM variant (emulate=True: the same kernel without subgroup matrices)."""
    c = v.cfg
    d = _EMU if emulate else _TC
    c.validate(max_threads=1 << 16, max_workgroup_bytes=1 << 30)
    if v.orient not in ("nt", "nn") or (v.orient == "nn" and v.chunked):
        raise ValueError(f"I8Variant orient={v.orient!r} chunked={v.chunked}: expected 'nt', or 'nn' with one chunk")
    direct = c.probe == "direct"
    if direct and (emulate or v.orient != "nt"):
        raise ValueError("the 'direct' probe needs subgroup matrices and orient 'nt'")
    if v.lora not in ("", "rows", "cols") or (v.lora and (v.orient != "nt" or v.chunked)):
        raise ValueError(f"I8Variant lora={v.lora!r} orient={v.orient!r} chunked={v.chunked}: '', 'rows' or 'cols', "
                         "with 'nt' and one chunk")  # fmt: skip
    if v.residual and v.accumulate:
        raise ValueError("I8Variant: residual and accumulate are exclusive (C = R + ... or C += ...)")
    cs_arr, cs_base = _cs_scratch(c)
    out, value = "C[i]", "prm.alpha * v[e] + lo[e]" if v.lora else "prm.alpha * v[e]"
    old_src = "R" if v.residual else "C"
    old = "old[e]" if c.old_ahead else f"{old_src}[i]"
    store = f"{out} = {old} + ({value});" if v.adds_old else f"{out} = {value};"
    if c.probe == "no_write":  # the values stay live, the stores (practically) never happen
        store = f"if (v[e] == 1.2345e-30) {{ {store} }}"
    return fill(
        kernel_text("matmul_i8.wgsl"),
        DIRECTIVES=("enable f16;\n" if v.lora else "") + d.directives,
        WRITE8_LORA=", lo: array<f32, 8>" if v.lora else "",
        WRITE8_OLD=", old: array<f32, 8>" if v.adds_old and c.old_ahead else "",
        OLD_SRC=old_src,
        RESIDUAL_BINDING=f"@group(0) @binding({8 if v.lora else 6}) var<storage, read> R: array<f32>;"
        if v.residual
        else "",
        EMULATION=fill(kernel_text("matmul_i8_emulation.wgsl"), CS_ARR=cs_arr, CS_BASE=cs_base) if emulate else "",
        CS_ARR=cs_arr,
        CS_BASE=cs_base,
        CS_DECL=""
        if c.cs_in_stage
        else f"var<workgroup> Cs: array<array<i32, {c.fm * MATRIX * MATRIX}>, NSG>;   "
        "// FM result matrices per subgroup (the scaling)",
        SG_PARAM=d.sg_param,
        SG_LET=d.sg_let,
        TM=c.tm,
        TN=c.tn,
        BM=c.bm,
        BN=c.bn,
        BK=c.bk,
        THREADS=c.threads,
        NSG=c.subgroups,
        SG_M=c.sg_m,
        SG_N=c.sg_n,
        GROUP_M=c.group_m,
        RASTER=kernel_text("matmul_raster.wgsl"),
        LDW=c.ldw,
        OPERAND="i32" if direct else "vec4<u32>",
        STAGE_DECLS="" if direct else _stage_decls(c),
        A_STAGING="" if direct else _row_staging("a"),
        B_STAGING="" if direct else _row_staging("b") if v.orient == "nt" else kernel_text("matmul_i8_b_nn.wgsl"),
        STORE_EXPR=store,
        LORA_BINDINGS=fill(
            kernel_text("matmul_i8_lora.wgsl"), LORA_BLOCK=_lora_block(v.lora, emulate), LS_LEN=c.fm * MATRIX * MATRIX
        )
        if v.lora
        else "",
        DECLS="\n".join(_decls(c, v, d)),
        MAIN_LOOP="\n".join(_main_loop(c, v, d)),
        EPILOGUE="\n".join(_scale_pass(c, v, d, " " * 4, "prm.chunks - 1u", final=True)),
    )
