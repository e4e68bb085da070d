"""Generate the tensor-core attention kernels (gpu/kernels/attention_tc_*.wgsl) for Dawn's subgroup matrices.

The static WGSL lives in the kernel files; this module fills in the parts that depend on head_dim D and the
tile width BC, fully unrolled with one named variable per subgroup matrix (no private arrays of matrices,
which would spill): the register-resident left operands, the score products, the accumulating products and
the epilogues that take f32 result matrices out through workgroup memory (their layout is opaque)."""

from __future__ import annotations

from collections.abc import Callable

from gpu.codegen import fill, kernel_text

MATRIX = 16  # side of one subgroup matrix (f16 x f16 -> f32, M16 N16 K16)
LEFT = "subgroup_matrix_left<f16, 16, 16>"
RIGHT = "subgroup_matrix_right<f16, 16, 16>"
RESULT = "subgroup_matrix_result<f32, 16, 16>"
ATTENTION_TC_HEAD_DIMS = (64, 128)
SUBGROUPS = 4  # subgroups per workgroup: 64 rows (queries, or keys in the dK/dV pass)
WIDE_FORWARD_SUBGROUPS = 8  # attention_tc_forward8: 128 query rows a workgroup share each staged key tile
THREADS = SUBGROUPS * 32
DS_BLOCK = SUBGROUPS * MATRIX  # keys a row block of the dS store holds: one dK/dV workgroup's (see ds_store_halves)


def tile_columns(kernel: str, head_dim: int, subgroups: int = SUBGROUPS) -> int:
    """BC, the streamed rows per tile: keys for the forward and dQ (64 at D = 64 on 4 subgroups, else 32), queries
    for dK/dV (32), keys for dQ from the stored dS ("dqs": 64, one key block of the dS store). Keeps the staged tiles
    and the per-subgroup blocks within 48 KiB of workgroup memory."""
    if kernel == "dqs":
        return DS_BLOCK
    return 64 if kernel != "dkv" and head_dim <= 64 and subgroups == SUBGROUPS else 32


def workgroup_rows(subgroups: int = SUBGROUPS) -> int:
    return subgroups * MATRIX


def _ind(lines: list[str], n: int) -> str:
    return "\n".join(" " * n + s for s in lines)


def _load(kind: str, arr: str, off: str, col_major: bool, stride: str) -> str:
    return f"subgroupMatrixLoad<{kind}>(&{arr}, {off}, {'true' if col_major else 'false'}, {stride})"


def _mma(a: str, b: str, acc: str) -> str:
    return f"{acc} = subgroupMatrixMultiplyAccumulate({a}, {b}, {acc});"


def _left_staged(
    name: str,
    src: str,
    blocks: tuple[str, str],
    row0: str,
    head: str,
    heads: str,
    nd: int,
    nb: int,
    subgroups: int = SUBGROUPS,
) -> str:
    """This subgroup's D/16 left matrices of rows row0 + 16 sg .. of the packed operand `src`, staged through the
    tile arrays `blocks` (the first holds BC rows; the second the next BC when BR > BC), so that every matrix
    load has a literal offset; with more subgroups than the two arrays hold blocks, in rounds of 2 NB subgroups.
    Ends with a barrier: the tile arrays are free again."""
    a, b = blocks

    def loads(arr: str, ind: str) -> list[str]:
        return [f"{ind}{name}{kk} = {_load(LEFT, arr, f'{kk * MATRIX}u', False, 'LDH')};" for kk in range(nd)]

    if nb >= subgroups:
        lines = [f"stage_{a}_{src}({row0}, {head}, {heads}, lid);", "workgroupBarrier();"]
        lines += [f"var {name}{kk}: {LEFT};" for kk in range(nd)] + loads(f"{a}[sg]", "")
        return _ind(lines + ["workgroupBarrier();"], 4)
    rounds = -(-subgroups // (2 * nb))
    lines = [f"var {name}{kk}: {LEFT};" for kk in range(nd)] if rounds > 1 else []
    for rnd in range(rounds):
        base = f"{row0} + {2 * rnd}u * BC" if rnd else row0
        lines += [
            f"stage_{a}_{src}({base}, {head}, {heads}, lid);",
            f"stage_{b}_{src}({base} + BC, {head}, {heads}, lid);",
            "workgroupBarrier();",
        ]
        if rounds == 1:
            lines += [f"var {name}{kk}: {LEFT};" for kk in range(nd)]
            lines += ["if (sg < NB) {", *loads(f"{a}[sg]", "    "), "} else {", *loads(f"{b}[sg - NB]", "    "), "}"]
        else:
            s0 = 2 * nb * rnd
            lines += [
                f"if (sg >= {s0}u && sg < {s0 + 2 * nb}u) {{",
                f"    if (sg - {s0}u < NB) {{",
                *loads(f"{a}[sg - {s0}u]", "        "),
                "    } else {",
                *loads(f"{b}[sg - {s0}u - NB]", "        "),
                "    }",
                "}",
                "workgroupBarrier();",
            ]
    return _ind(lines if rounds > 1 else lines + ["workgroupBarrier();"], 4)


def _decl(names: list[str]) -> str:
    return _ind([f"var {n} = {RESULT}();" for n in names], 4)


Live = Callable[[int], str] | None  # block c's WGSL condition: whether the causal mask leaves any of it (None: all)


def _when(live: Live, c: int, mmas: list[str]) -> list[str]:
    """`mmas` (lines at 4 spaces) run only where block c is live: skipped, a masked block's products add zeros (P
    or dS) or give scores the mask replaces, so the results are bitwise those of running them."""
    if live is None:
        return mmas
    return [f"    if ({live(c)}) {{", *("    " + s for s in mmas), "    }"]


def _keys_live(c: int) -> str:
    """Key block c of the tile at j0 against the subgroup's queries i0 .. i0 + 15: some key at or before a query."""
    return f"j0 + {c * MATRIX}u <= i0 + {MATRIX - 1}u"


def _queries_live(c: int) -> str:
    """Query block c of the tile at i0 against the subgroup's keys j0 .. j0 + 15: some query at or after a key."""
    return f"i0 + {c * MATRIX + MATRIX - 1}u >= j0"


def _scores(left: str, tile: str, nc: int, nd: int, out: str = "Ss", live: Live = None) -> list[str]:
    """X_c = sum_kk left_kk . tile_c^T for each 16-row block c of a staged tile (read col-major), stored to
    this subgroup's `out` (Ss, or Ds: the paired backward's dP) at column 16 c; live: see _when."""
    lines = ["{"]
    for c in range(nc):
        lines.append(f"    var x{c} = {RESULT}();")
        mmas = [
            f"    {_mma(f'{left}{kk}', _load(RIGHT, f'{tile}[{c}]', f'{kk * MATRIX}u', True, 'LDH'), f'x{c}')}"
            for kk in range(nd)
        ]
        lines += _when(live, c, mmas)
        lines.append(f"    subgroupMatrixStore(&{out}[sg], {c * MATRIX}u, x{c}, false, LDS);")
    return lines + ["}"]


def _accumulate(
    pairs: list[tuple[str, str, str]], nc: int, nd: int, then: dict[str, str] | None = None, live: Live = None
) -> list[str]:
    """For each (this subgroup's f16 block array, staged tile, result prefix): R_n += sum_kk block[:, 16 kk..]
    . tile_kk[:, 16 n..] (tile blocks read row-major). then: a statement by block array, run after each of its
    blocks is loaded ({a}: the loaded matrix, {kk}: its block), live or not; live: see _when."""
    lines = ["{"]
    for kk in range(nc):
        for src, tile, acc in pairs:
            a = f"a_{src}_{kk}"
            lines.append(f"    let {a} = {_load(LEFT, f'{src}[sg]', f'{kk * MATRIX}u', False, 'LDP')};")
            if then and src in then:
                lines.append("    " + then[src].format(a=a, kk=kk))
            mmas = [
                f"    {_mma(a, _load(RIGHT, f'{tile}[{kk}]', f'{n * MATRIX}u', False, 'LDH'), f'{acc}{n}')}"
                for n in range(nd)
            ]
            lines += _when(live, kk, mmas)
    return lines + ["}"]


def _store_rows(accs: list[tuple[str, str]], nd: int, live: str) -> str:
    """Each result matrix through this subgroup's Ss to its output rows: lane (r, half) writes row r,
    columns 8 half..+8, times `inv`, when `live`."""
    lines = []
    for acc, out in accs:
        for n in range(nd):
            lines += [
                "workgroupBarrier();",
                f"subgroupMatrixStore(&Ss[sg], 0u, {acc}{n}, false, LDS);",
                "workgroupBarrier();",
                f"if ({live}) {{",
            ]
            for q in range(2):
                vals = ", ".join(f"Ss[sg][r * LDS + half * 8u + {4 * q + e}u]" for e in range(4))
                lines.append(f"    {out}[ob + {4 * n + q}u] = vec4<f32>({vals}) * inv;")
            lines.append("}")
    return _ind(lines, 4)


def _staging_fns(stage: list[tuple[str, str]], units: list[tuple[str, str]]) -> str:
    """The staging functions of a kernel: fn load_<src>(row0, head, heads, u) reads staging unit u (8 halves:
    row u / (D / 8), columns 8 (u % (D / 8)) ..) of a BC-row tile of head `head` of the packed operand `src`
    ([T_pad, heads, D] as 8-half units); fn put_<dst>(u, x) writes it to the 16-row blocks of `dst`; for each
    (dst, src) of `stage`, fn stage_<dst>_<src>(row0, head, heads, lid) moves a whole tile (the left matrices'
    one-off staging). `units` names the (dst, src) pairs a kernel prefetches through registers (_prefetch)."""
    pairs = stage + units
    dsts, srcs = dict.fromkeys(d for d, _ in pairs), dict.fromkeys(s for _, s in pairs)
    fns = [
        f"""
fn load_{src}(row0: u32, head: u32, heads: u32, u: u32) -> vec4<u32> {{
    return {src}[((row0 + u / (D / 8u)) * heads + head) * (D / 8u) + u % (D / 8u)];
}}"""
        for src in srcs
    ]
    for dst in dsts:
        stores = "\n".join(
            f"    {dst}[row / 16u][o + {e}u] = {half}.{c};"
            for e, (half, c) in enumerate((h, c) for h in ("lo", "hi") for c in "xyzw")
        )
        fns.append(f"""
fn put_{dst}(u: u32, x: vec4<u32>) {{
    let row = u / (D / 8u);
    let o = (row % 16u) * LDH + (u % (D / 8u)) * 8u;
    let lo = bitcast<vec4<f16>>(x.xy);
    let hi = bitcast<vec4<f16>>(x.zw);
{stores}
}}""")
    fns += [
        f"""
fn stage_{dst}_{src}(row0: u32, head: u32, heads: u32, lid: u32) {{
    for (var u = lid; u < BC * D / 8u; u += THREADS) {{
        put_{dst}(u, load_{src}(row0, head, heads, u));
    }}
}}"""
        for dst, src in stage
    ]
    return "".join(fns)


def _units(rows: int, head_dim: int, threads: int = THREADS) -> int:
    """Staging units (8 halves) per thread of a rows x head_dim tile."""
    units, rest = divmod(rows * head_dim // 8, threads)
    assert not rest, (rows, head_dim, threads)
    return units


def _prefetch(
    pairs: list[tuple[str, str, str]], head: str, heads: str, units: int, rows: tuple[str, str] = ("zr", "zr + j0 + BC")
) -> dict[str, str]:
    """PREFETCH_FIRST / _STORE / _NEXT: for each (tile array, packed operand, register prefix) this thread's
    `units` staging units (lid + THREADS q) of the first tile (row rows[0]) loaded into registers, written to
    the tile arrays, and the next tile's (row rows[1]) loaded."""

    def loads(row0: str, decl: bool) -> list[str]:
        kw = "var " if decl else ""
        return [
            f"{kw}{reg}{q} = load_{src}({row0}, {head}, {heads}, lid + {q}u * THREADS);"
            for _, src, reg in pairs
            for q in range(units)
        ]

    store = [f"put_{dst}(lid + {q}u * THREADS, {reg}{q});" for dst, _, reg in pairs for q in range(units)]
    return {
        "PREFETCH_FIRST": _ind(loads(rows[0], True), 4),
        "PREFETCH_STORE": _ind(store, 8),
        "PREFETCH_NEXT": _ind(loads(rows[1], False), 12),
    }


def _common(kernel: str, head_dim: int, subgroups: int = SUBGROUPS) -> str:
    bc = tile_columns(kernel, head_dim, subgroups)
    common = fill(kernel_text("attention_tc_common.wgsl"), D=head_dim, BC=bc, NSG=subgroups)
    return common + "\n" + kernel_text("grad_scale.wgsl")


_FILES = {
    "forward": "attention_tc_forward.wgsl",
    "dq": "attention_tc_backward_dq.wgsl",
    "dkv": "attention_tc_backward_dkv.wgsl",
    "dqs": "attention_tc_backward_dqs.wgsl",
}


def _blocks(kernel: str, head_dim: int, subgroups: int = SUBGROUPS) -> tuple[int, int]:
    """(nd, nc) of `kernel` ("forward", "dq" or "dkv"): 16-wide blocks across the head dim and across a streamed
    tile (ValueError for a head dim no kernel is generated for)."""
    if head_dim not in ATTENTION_TC_HEAD_DIMS:
        raise ValueError(f"tensor-core attention: head_dim={head_dim}; generated for {ATTENTION_TC_HEAD_DIMS}")
    return head_dim // MATRIX, tile_columns(kernel, head_dim, subgroups) // MATRIX


def _source(kernel: str, head_dim: int, subgroups: int = SUBGROUPS, **values: str) -> str:
    """`kernel`'s WGSL: the common part (attention_tc_common.wgsl, grad_scale.wgsl), then its body file filled."""
    return _common(kernel, head_dim, subgroups) + "\n" + fill(kernel_text(_FILES[kernel]), **values)


def _pv_accumulate(nc: int, nd: int, live: Live = None) -> list[str]:
    """The forward's O += P V for one key tile, straight into the result matrices o0 .. (P from this subgroup's Ps,
    V's blocks from the staged tile); live: see _when."""
    lines = ["{"]
    for kk in range(nc):
        lines.append(f"    let a{kk} = {_load(LEFT, 'Ps[sg]', f'{kk * MATRIX}u', False, 'LDP')};")
        mmas = [
            f"    {_mma(f'a{kk}', _load(RIGHT, f'Vs[{kk}]', f'{n * MATRIX}u', False, 'LDH'), f'o{n}')}"
            for n in range(nd)
        ]
        lines += _when(live, kk, mmas)
    return lines + ["}"]


def _o_rescaled(nc: int, nd: int) -> list[str]:
    """O's result matrices times alpha row by row: as many as a row of Ss holds (BC / 16) stored, each lane
    scaling its share of its row (8 BC / 16 columns from 8 BC / 16 * half), loaded back."""
    share = 8 * nc
    lines: list[str] = []
    for n0 in range(0, nd, nc):
        chunk = range(n0, min(nd, n0 + nc))
        lines += [f"subgroupMatrixStore(&Ss[sg], {(n - n0) * MATRIX}u, o{n}, false, LDS);" for n in chunk]
        lines += [
            "workgroupBarrier();",
            f"for (var c = 0u; c < {share}u; c++) {{",
            f"    Ss[sg][r * LDS + half * {share}u + c] *= alpha;",
            "}",
            "workgroupBarrier();",
        ]
        lines += [f"o{n} = {_load(RESULT, 'Ss[sg]', f'{(n - n0) * MATRIX}u', False, 'LDS')};" for n in chunk]
        lines.append("workgroupBarrier();")
    return lines


def _softmax_rows(bc: int) -> tuple[list[str], list[str]]:
    """The forward's online-softmax step for one key tile, unrolled, in two parts. SOFTMAX_MAX: this lane's BC / 2
    scores of row i (column pairs 4 m + 2 half + {0, 1}) read from Ss once into registers, masked (key j0 + c > i)
    and scaled; the row's tile max tmax_row (with the other half's). SOFTMAX_P (after the reference max mn is
    chosen): P = exp(s - mn) to Ps (f16), its sum into part."""
    cols = _lane_columns(bc)
    first = [
        f"let s{k} = select(NEG_BIG, Ss[sg][xb + {c}u] * prm.scale, j0 + 2u * half + {c}u <= i);"
        for k, c in enumerate(cols)
    ]
    tmax = "s0"
    for k in range(1, len(cols)):
        tmax = f"max({tmax}, s{k})" if k % 8 else f"max(tmax{k // 8 - 1}, s{k})"
        if k % 8 == 7:
            first.append(f"let tmax{k // 8} = {tmax};")
    first += [
        f"let tmax = tmax{len(cols) // 8 - 1};",
        "let tmax_row = max(tmax, subgroupShuffleXor(tmax, 16u));",
    ]
    second = ["var part = 0.0;"]
    for k, c in enumerate(cols):
        second += [
            f"let p{k} = select(0.0, exp(s{k} - mn), j0 + 2u * half + {c}u <= i);",
            f"part += p{k};",
            f"Ps[sg][r * LDP + 2u * half + {c}u] = f16(p{k});",
        ]
    return first, second


def _lane_columns(bc: int) -> list[int]:
    """This lane's columns of a [16][BC] block, less 2 half: the pairs 4 m + {0, 1} (see attention_tc_common)."""
    return [4 * (k >> 1) + (k & 1) for k in range(bc // 2)]


def _backward_rows(kernel: str, bc: int, dp: str = "Ss") -> tuple[list[str], list[str]]:
    """The P and dS rows of the dQ (kernel "dq") or dK/dV ("dkv") pass, unrolled over this lane's BC / 2 columns
    of its row: P = exp(S * scale - L) (masked, rounded to f16) to Ps and kept in registers, then dS = P (dP -
    delta) * scale from them and dP in `dp` (Ss after S, or Ds beside it: the paired tile body) (the same values
    as re-reading P from Ps). The dQ pass writes dS over P, so with dP beside S it does not store P at all."""
    p_rows, ds_rows = [], []
    for k, c in enumerate(_lane_columns(bc)):
        col = f"2u * half + {c}u"
        if kernel == "dq":
            lse, live, delta, ds_out = "lse", f"j0 + {col} <= i", "delta", "Ps"
        else:
            lse, live, delta, ds_out = f"Lc[{col}]", f"i0 + {col} >= j && i0 + {col} < prm.T", f"Dc[{col}]", "dSs"
        p_rows.append(f"let p{k} = f16(select(0.0, exp(Ss[sg][xb + {c}u] * prm.scale - {lse}), {live}));")
        if kernel != "dq" or dp == "Ss":
            p_rows.append(f"Ps[sg][r * LDP + {col}] = p{k};")
        ds_rows.append(f"{ds_out}[sg][r * LDP + {col}] = f16(f32(p{k}) * ({dp}[sg][xb + {c}u] - {delta}) * prm.scale);")
    return p_rows, ds_rows


def _tile_body(kernel: str, bc: int, s_mma: list[str], dp_mma: list[str], grad_mma: list[str], paired: bool) -> str:
    """A backward pass's work on one streamed tile: S, P, dP, dS and the gradient products, with a barrier between
    each step (dP over S in Ss); paired: S and dP side by side (Ss, Ds) before one barrier, then P and dS in one
    pass over the lanes, then the products: 4 barriers a tile instead of 6, for DP_ARRAY's f32 blocks."""
    barrier = "        workgroupBarrier();"
    if not paired:
        p_rows, ds_rows = _backward_rows(kernel, bc)
        steps = [_ind(s_mma, 8), _ind(p_rows, 8), _ind(dp_mma, 8), _ind(ds_rows, 8), _ind(grad_mma, 8)]
        return f"\n{barrier}\n".join(steps)
    p_rows, ds_rows = _backward_rows(kernel, bc, "Ds")
    return "\n".join([_ind(s_mma + dp_mma, 8), barrier, _ind(p_rows + ds_rows, 8), barrier, _ind(grad_mma, 8)])


_DP_ARRAY = "var<workgroup> Ds: array<array<f32, 16 * LDS>, NSG>;   // dP beside S (the paired tile body)\n"


def forward_source(head_dim: int, subgroups: int = SUBGROUPS, skip_masked: bool = False, one_flag: bool = False) -> str:
    """attention_tc_forward for one head dim, with `subgroups` of 16 query rows a workgroup (4; or
    WIDE_FORWARD_SUBGROUPS, on key tiles of 32 so that the staged tiles and per-subgroup blocks still fit 48 KiB).
    skip_masked: a subgroup skips the products of a 16-key block past its last query (bitwise the same). one_flag:
    each subgroup moves its own reference max, and the flags' exchange after P's store is the tile's last barrier
    (one barrier pair a tile fewer; P rounded against per-subgroup maxima: within the tolerance, not bitwise)."""
    nd, nc = _blocks("forward", head_dim, subgroups)
    live = _keys_live if skip_masked else None
    if subgroups not in (SUBGROUPS, WIDE_FORWARD_SUBGROUPS):
        raise ValueError(f"tensor-core attention forward: {subgroups} subgroups at head_dim={head_dim}")
    soft_max, soft_p = _softmax_rows(nc * MATRIX)
    threads = subgroups * 32
    return _source(
        "forward",
        head_dim,
        subgroups,
        STAGE_FNS=_staging_fns([("Ks", "Q16"), ("Vs", "Q16")], [("Ks", "K16"), ("Vs", "V16")]),
        Q_LOAD=_left_staged("q", "Q16", ("Ks", "Vs"), "zr + w0", "h", "prm.HQ", nd, nc, subgroups),
        O_DECL=_decl([f"o{n}" for n in range(nd)]),
        S_MMA=_ind(_scores("q", "Ks", nc, nd, live=live), 8),
        SOFTMAX_MAX=_ind(soft_max, 8),
        **_flag_exchange(subgroups, one_flag),
        SOFTMAX_P=_ind(soft_p, 8),
        O_RESCALE=_ind(_o_rescaled(nc, nd), 12),
        PV_MMA=_ind(_pv_accumulate(nc, nd, live), 8),
        O_STORE=_store_rows([("o", "O")], nd, "i < prm.T"),
        **_prefetch([("Ks", "K16", "kr"), ("Vs", "V16", "vr")], "g", "prm.HKV", _units(nc * MATRIX, head_dim, threads)),
    )


def _flag_exchange(subgroups: int, one_flag: bool) -> dict[str, str]:
    """FLAGS_BEFORE_P / MOVES / FLAGS_AFTER_P of the forward: where the subgroups' grow flags are exchanged (before
    P, all rows moving with any subgroup's; or after P's store, each subgroup's own, its barrier the tile's last)."""
    exchange = [
        "if (lane == 0u) {",
        "    Grow[sg] = select(0u, 1u, up);",
        "}",
        "let grow = workgroupUniformLoad(&Grow);",
        "let moved = (" + " | ".join(f"grow[{k}]" for k in range(subgroups)) + ") != 0u;",
    ]
    if one_flag:
        return {"FLAGS_BEFORE_P": "", "MOVES": "up", "FLAGS_AFTER_P": _ind(exchange, 8)}
    return {"FLAGS_BEFORE_P": _ind(exchange, 8), "MOVES": "moved", "FLAGS_AFTER_P": _ind(["workgroupBarrier();"], 8)}


def backward_dq_source(head_dim: int, paired: bool = False) -> str:
    """attention_tc_backward_dq for one head dim; paired: S and dP side by side (_tile_body; head dim 128 only,
    where Ds fits 48 KiB of workgroup memory beside the key tiles)."""
    nd, nc = _blocks("dq", head_dim)
    if paired and head_dim != 128:
        raise ValueError(f"the paired dQ pass is generated for head_dim 128, not {head_dim}")
    return _source(
        "dq",
        head_dim,
        STAGE_FNS=_staging_fns([(a, b) for a in ("Ks", "Vs") for b in ("Q16", "dO16")], [("Ks", "K16"), ("Vs", "V16")]),
        Q_LOAD=_left_staged("q", "Q16", ("Ks", "Vs"), "zr + w0", "h", "prm.HQ", nd, nc),
        DO_LOAD=_left_staged("go", "dO16", ("Ks", "Vs"), "zr + w0", "h", "prm.HQ", nd, nc),
        DQ_DECL=_decl([f"dq{n}" for n in range(nd)]),
        TILE_BODY=_tile_body(
            "dq",
            nc * MATRIX,
            _scores("q", "Ks", nc, nd),
            _scores("go", "Vs", nc, nd, "Ds" if paired else "Ss"),
            _accumulate([("Ps", "Ks", "dq")], nc, nd),
            paired,
        ),
        DP_ARRAY=_DP_ARRAY if paired else "",
        DQ_STORE=_store_rows([("dq", "dQ")], nd, "i < prm.T"),
        **_prefetch([("Ks", "K16", "kr"), ("Vs", "V16", "vr")], "g", "prm.HKV", _units(nc * MATRIX, head_dim)),
    )


def backward_dkv_source(head_dim: int, paired: bool = False, store_ds: bool = False, skip_masked: bool = False) -> str:
    """attention_tc_backward_dkv for one head dim; paired: S^T and dP^T side by side (_tile_body); store_ds (paired
    only): each dS^T block, as loaded for dK += dS^T Q, also stored to the dS store DSt (binding 5; L read from
    stats' copy), for attention_tc_backward_dqs. skip_masked: a subgroup skips the products of a 16-query block
    before its first key (bitwise the same; the store still gets the block's zeros)."""
    nd, nc = _blocks("dkv", head_dim)
    live = _queries_live if skip_masked else None
    if store_ds and not paired:
        raise ValueError("the dS store is generated for the paired dK/dV pass only")
    # each dS^T block, once loaded for dK, to the store: this subgroup's keys, query tile t BC / 16 + kk
    put = "subgroupMatrixStore(&DSt, ds_row + (t * (BC / 16u) + {kk}u) * 256u, {a}, false, 16u);"
    store = {"dSs": put} if store_ds else None
    grad_mma = _accumulate([("Ps", "dOs", "dv"), ("dSs", "Qs", "dk")], nc, nd, store, live)
    return _source(
        "dkv",
        head_dim,
        STAGE_FNS=_staging_fns(
            [(a, b) for a in ("Qs", "dOs") for b in ("K16", "V16")], [("Qs", "Q16"), ("dOs", "dO16")]
        )
        + (_DS_FNS if store_ds else ""),
        L_BINDING="@group(0) @binding(5) var<storage, read_write> DSt: array<f16>;   // the dS store"
        if store_ds
        else "@group(0) @binding(5) var<storage, read> L: array<f32>;",
        NWG_PARAM="    @builtin(num_workgroups) nwg: vec3<u32>,\n" if store_ds else "",
        DS_SETUP=_ind(
            [
                "let ds_nw = ds_blocks();",
                "let ds_nq = (ds_nw - wid.x) * (DS_BLOCK / 16u);   // query tiles of this key block in the store",
                "let ds_row = ds_plane(z, h, ds_nw) + ds_block_start(wid.x, ds_nw) + sg * ds_nq * 256u;",
            ],
            4,
        )
        + "\n"
        if store_ds
        else "",
        LSE_AT="stats.delta[(nwg.z + z) * prm.HQ * prm.T + row]" if store_ds else "L[z * prm.LS + row]",
        K_LOAD=_left_staged("kl", "K16", ("Qs", "dOs"), "zr + w0", "g", "prm.HKV", nd, nc),
        V_LOAD=_left_staged("vl", "V16", ("Qs", "dOs"), "zr + w0", "g", "prm.HKV", nd, nc),
        DKV_DECL=_decl([f"dk{n}" for n in range(nd)] + [f"dv{n}" for n in range(nd)]),
        TILE_BODY=_tile_body(
            "dkv",
            nc * MATRIX,
            _scores("kl", "Qs", nc, nd, live=live),
            _scores("vl", "dOs", nc, nd, "Ds" if paired else "Ss", live),
            grad_mma,
            paired,
        ),
        DP_ARRAY=_DP_ARRAY if paired else "",
        DKV_STORE=_store_rows([("dk", "dK"), ("dv", "dV")], nd, "j < prm.T"),
        **_prefetch(
            [("Qs", "Q16", "qr"), ("dOs", "dO16", "dor")],
            "h",
            "prm.HQ",
            _units(nc * MATRIX, head_dim),
            rows=("zr + w0", "zr + i0 + BC"),
        ),  # fmt: skip
    )


# The dS store (f16, dS^T * scale * sigma as the dK/dV pass rounds it): per sequence z and query head h a plane of
# key blocks of DS_BLOCK keys, nw = ceil(T / DS_BLOCK) of them; block w holds its keys against the queries from its
# first key on (causal: the others are zero) as 16 x 16 tiles of 256 contiguous halves (row-major, [key][query]:
# one subgroup matrix each, stored and loaded whole), tile (key tile a, query tile q) at ds_plane +
# ds_block_start(w) + (a nq + q) 256, nq = (nw - w) DS_BLOCK / 16, for keys DS_BLOCK w + 16 a .. and queries
# DS_BLOCK w + 16 q ...
_DS_FNS = f"""
const DS_BLOCK: u32 = {DS_BLOCK}u;

fn ds_blocks() -> u32 {{
    return (prm.T + DS_BLOCK - 1u) / DS_BLOCK;
}}

fn ds_block_start(w: u32, nw: u32) -> u32 {{   // halves before key block w of a plane (w = nw: the plane's size)
    return DS_BLOCK * DS_BLOCK * (w * nw - w * (w - 1u) / 2u);
}}

fn ds_plane(z: u32, h: u32, nw: u32) -> u32 {{
    return (z * prm.HQ + h) * ds_block_start(nw, nw);
}}
"""


def ds_store_halves(seq_len: int, n_heads: int, n_seqs: int) -> int:
    """Halves of the dS store for n_seqs sequences of seq_len and n_heads query heads (_DS_FNS's layout)."""
    nw = -(-seq_len // DS_BLOCK)
    return n_seqs * n_heads * DS_BLOCK * DS_BLOCK * (nw * nw - nw * (nw - 1) // 2)


def backward_dqs_source(head_dim: int, skip_masked: bool = False) -> str:
    """attention_tc_backward_dqs for one head dim: dQ = dS K from the dS store (attention_tc_backward_dkv with
    store_ds run first), K's key tiles of DS_BLOCK staged through registers, this subgroup's dS blocks of the next
    tile loaded from the store during this tile's products. skip_masked: as forward_source's."""
    nd, nc = _blocks("dqs", head_dim)
    live = _keys_live if skip_masked else None

    def ds_loads(tile: str) -> list[str]:
        """This subgroup's dS blocks of key tile `tile` (key block `tile` of the store) into dn0 ..: dS [16 queries,
        16 keys] read column-major from the store's dS^T tiles."""
        lines = [
            f"let ds_t = {tile};",
            "let ds_nq = (ds_nw - ds_t) * (DS_BLOCK / 16u);",
            "let ds_at = ds_base + ds_block_start(ds_t, ds_nw) + (i0 - ds_t * DS_BLOCK) / 16u * 256u;",
        ]
        return lines + [
            f"dn{kk} = {_load(LEFT, 'DSt', f'ds_at + {kk}u * ds_nq * 256u', True, '16u')};" for kk in range(nc)
        ]

    mma = ["{"]
    for kk in range(nc):
        mmas = [
            f"    {_mma(f'da{kk}', _load(RIGHT, f'Ks[{kk}]', f'{n * MATRIX}u', False, 'LDH'), f'dq{n}')}"
            for n in range(nd)
        ]
        mma += _when(live, kk, mmas)
    mma.append("}")
    return _source(
        "dqs",
        head_dim,
        STAGE_FNS=_staging_fns([], [("Ks", "K16")]) + _DS_FNS,
        DQ_DECL=_decl([f"dq{n}" for n in range(nd)]),
        DS_FIRST=_ind([f"var dn{kk}: {LEFT};" for kk in range(nc)] + ["{", *ds_loads("0u"), "}"], 4),
        DS_TAKE=_ind([f"let da{kk} = dn{kk};" for kk in range(nc)], 8),
        DS_NEXT=_ind(ds_loads("t + 1u"), 12),
        DQ_MMA=_ind(mma, 8),
        DQ_STORE=_store_rows([("dq", "dQ")], nd, "i < prm.T"),
        **_prefetch([("Ks", "K16", "kr")], "g", "prm.HKV", _units(nc * MATRIX, head_dim), rows=("zr", "zr + j0 + BC")),
    )


def pack_source(scaled: bool) -> str:
    """pack_f16: f16 copy of an f32 tensor (q, k, v, GEMM inputs; scaled=False) or of x * sigma (scaled=True:
    attention's dO, the KD head's dL/dlogits; sigma from grad_scale.wgsl)."""
    binding = "@group(0) @binding(3) var<storage, read> stats: Stats;" if scaled else ""
    text = fill(
        kernel_text("pack_f16.wgsl"),
        STATS_BINDING=binding,
        SIGMA="grad_scale(stats.max_bits)" if scaled else "1.0",
    )
    return text + ("\n" + kernel_text("grad_scale.wgsl") if scaled else "")


def pack_rope_source(neox: bool) -> str:
    """pack_f16_rope: attention's q or k packed to f16 with RoPE applied on the way (NEOX pairs or adjacent ones)."""
    return fill(kernel_text("pack_f16_rope.wgsl"), NEOX="true" if neox else "false")


def delta_source(head_dim: int) -> str:
    """attention_tc_delta for one head dim."""
    return fill(kernel_text("attention_tc_delta.wgsl"), DV=head_dim // 4)


def reduce_source() -> str:
    return kernel_text("attention_tc_reduce.wgsl")
