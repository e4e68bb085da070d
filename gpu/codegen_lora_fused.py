"""Template values of lora_fused (gpu/kernels/lora_fused.wgsl): one workgroup owns BM token rows and computes
t_blk = alpha1 X_blk W1 (the rank-r reduction, kept in workgroup memory and written out), then
Y_blk += alpha2 t_blk W2 (the expansion), in one dispatch. Each rank bucket RB (the kernel covers r <= RB) has its
own tile constants; the staging loads of a step are written out as straight-line statements and kept DEPTH steps
ahead in registers (a ring of register sets), so that one workgroup has several steps of loads in flight: at
T = 4096 rows there are only 256 workgroups (about two per H200 SM), so bytes in flight per workgroup, not
occupancy, hide the memory latency."""

from __future__ import annotations

BM = 16  # token rows per workgroup
THREADS = 256
RANK_BUCKETS = (8, 16, 32, 64)  # RB: the kernel covers ranks r <= RB (r <= 64 in all)
REDUCE_BK = {8: 128, 16: 64, 32: 64, 64: 32}  # RB -> reduction steps staged per tile
EXPAND_FLOATS = 2048  # RB x NB: W2 values staged per column block of the expansion
DEPTH_REDUCE = 4  # staged reduction steps whose loads are in flight at once
DEPTH_EXPAND = 2  # column blocks whose loads are in flight at once
WORKGROUP_BYTES = 16384  # WebGPU's default maxComputeWorkgroupStorageSize


def rank_bucket(r: int) -> int | None:
    """The smallest rank bucket covering rank r, or None when r exceeds them all (the two-product path)."""
    return next((rb for rb in RANK_BUCKETS if r <= rb), None)


def _consts(rb: int) -> dict[str, int]:
    bk = REDUCE_BK[rb]
    tiles = (BM // 4) * (rb // 4)  # 4 x 4 micro tiles of t_blk [BM, RB]
    kg = THREADS // tiles  # reduction lanes: each micro tile's k range is split over kg threads
    sx = bk // 4 + 1  # padded row stride (vec4) of the staged X and W1 tiles
    nb = EXPAND_FLOATS // rb  # columns per expansion block
    s_len = max((BM + rb) * sx, (kg // 2) * tiles * 4, (rb * (nb + 1) + 3) // 4)
    return {
        "BK": bk,
        "KG": kg,
        "CPK": bk // 4 // kg,  # 4-step chunks per lane per staged tile
        "SX": sx,
        "NB": nb,
        "G2": THREADS // nb,  # row groups of the expansion
        "S_LEN": s_len,
        "X_UNITS": BM * bk // THREADS,
        "W1_UNITS": rb * bk // THREADS,
        "W2_UNITS": rb * nb // THREADS,
        "RPT2": BM * nb // THREADS,  # rows per thread in the expansion
    }


def workgroup_bytes(rb: int) -> int:
    """Workgroup memory of variant rb: the shared staging array S and t_blk."""
    c = _consts(rb)
    return 16 * c["S_LEN"] + 4 * BM * rb


def lora_fused_values(rb: int) -> dict[str, object]:
    """${RB} and the tile constants, and the unrolled register-ring statements of both phases for bucket rb."""
    c = _consts(rb)
    if c["CPK"] < 1 or workgroup_bytes(rb) > WORKGROUP_BYTES:
        raise ValueError(f"lora_fused rb={rb}: tile constants {c} do not fit (gpu/codegen_lora_fused.py)")
    d1, d2, rpt2 = DEPTH_REDUCE, DEPTH_EXPAND, c["RPT2"]
    x1 = [f"x{d}_{q}" for d in range(d1) for q in range(c["X_UNITS"])]
    w1 = [f"w{d}_{q}" for d in range(d1) for q in range(c["W1_UNITS"])]
    w2 = [f"v{d}_{q}" for d in range(d2) for q in range(c["W2_UNITS"])]
    y2 = [f"y{d}_{i}" for d in range(d2) for i in range(rpt2)]

    def load1(d: int, stage: str) -> str:
        xs = [f"x{d}_{q} = load_x(l + {q * THREADS}u, m0, {stage});" for q in range(c["X_UNITS"])]
        ws = [f"w{d}_{q} = load_w1(l + {q * THREADS}u, {stage});" for q in range(c["W1_UNITS"])]
        return "\n            ".join(xs + ws)

    def stage1(d: int) -> str:
        xs = [f"stage_x(l + {q * THREADS}u, x{d}_{q});" for q in range(c["X_UNITS"])]
        ws = [f"stage_w1(l + {q * THREADS}u, w{d}_{q});" for q in range(c["W1_UNITS"])]
        return "\n            ".join(xs + ws)

    def load2(d: int, block: str) -> str:
        vs = [f"v{d}_{q} = load_w2(l + {q * THREADS}u, {block});" for q in range(c["W2_UNITS"])]
        ys = [f"y{d}_{i} = load_y(m0 + g + {i}u * G2, {block} * NB + cn);" for i in range(rpt2)]
        return "\n            ".join(vs + ys)

    def body1(d: int) -> str:
        return f"""if (s + {d}u < n_steps) {{
            workgroupBarrier();
            {stage1(d)}
            workgroupBarrier();
            {load1(d, f"(s + {d + d1}u) * BK")}
            reduce_tile(kg, mq, jq);
        }}"""

    def body2(d: int) -> str:
        stores = [f"stage_w2(l + {q * THREADS}u, v{d}_{q});" for q in range(c["W2_UNITS"])]
        olds = [f"let o{i} = y{d}_{i};" for i in range(rpt2)]
        outs = [f"store_y(m0 + g + {i}u * G2, n, o{i} + alpha2 * e{i});" for i in range(rpt2)]
        sep = "\n            "
        return f"""if (b + {d}u < n_blocks) {{
            workgroupBarrier();
            {sep.join(stores)}
            workgroupBarrier();
            {sep.join(olds)}
            {load2(d, f"(b + {d + d2}u)")}
            expand_block(g, cn);
            let n = (b + {d}u) * NB + cn;
            {sep.join(outs)}
        }}"""

    terms = "\n        ".join(f"e{i} += dot(Ts[(g + {i}u * G2) * JT + q], w);" for i in range(rpt2))
    return {
        "RB": rb,
        **{k: c[k] for k in ("BK", "KG", "CPK", "SX", "NB", "G2", "S_LEN")},
        "DEPTH_REDUCE": d1,
        "DEPTH_EXPAND": d2,
        "PRIVATE_EXPAND": "\n".join(f"var<private> e{i}: f32;" for i in range(rpt2)),
        "ZERO_EXPAND": "\n    ".join(f"e{i} = 0.0;" for i in range(rpt2)),
        "EXPAND_TERMS": terms,
        "DECLARE_REDUCE": "\n    ".join(f"var {v} = 0.0;" for v in x1 + w1),
        "PROLOGUE_REDUCE": "\n    ".join(load1(d, f"{d}u * BK") for d in range(d1)),
        "BODY_REDUCE": "\n        ".join(body1(d) for d in range(d1)),
        "DECLARE_EXPAND": "\n    ".join(f"var {v} = 0.0;" for v in w2 + y2),
        "PROLOGUE_EXPAND": "\n    ".join(load2(d, f"{d}u") for d in range(d2)),
        "BODY_EXPAND": "\n        ".join(body2(d) for d in range(d2)),
    }
