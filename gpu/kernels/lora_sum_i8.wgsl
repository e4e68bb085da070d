// dB = s dY^T t on the integer tensor cores (gpu/ops/lora_db_i8.py), first pass: the i32 sums over one chunk of
// rows per workgroup row z, P[z, i, n] = sum over m in the chunk of L(m, i) R_n(m) (P: D rows of N per chunk);
// lora_sum_i8_finish.wgsl adds the chunks with their scales. L: the large operand's int8 codes [M, D], row m
// contiguous along i (dY sW as the input gradient's GEMM takes it; packed four per u32 word); R_n: row n of the thin
// operand's codes stored by columns ([N, M]: column n of u along the rows, lora_cols_i8.wgsl), each chunk of rows
// with its own scale per column. Workgroup: 4 subgroups of 16 outputs i each and all N = 16 NB columns. Per step
// BK rows m of the tile's BI codes of L and of the N rows of R are staged in workgroup memory as i32 words, the next
// step's loaded into registers meanwhile (lora_i8_steps.wgsl); each subgroup multiplies its 16 columns of L (left
// matrices loaded column-major: L^T) by the NB column blocks, BK / 32 integer MMAs each. ${COMPUTE_NOTE}
${DIRECTIVES}

struct Params {
    M: u32,        // rows of L and of R (a multiple of BK)
    D: u32,        // L's row length, the outputs i (a multiple of BI)
    N: u32,        // output columns, a multiple of 16, at most BN
    chunk: u32,    // rows per workgroup row z (a multiple of BK)
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> L: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> R: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> P: array<i32>;

const BI: u32 = 64u;             // outputs i per workgroup (16 per subgroup)
const BK: u32 = 64u;             // rows m per step
const UPR: u32 = BK / 16u;       // vec4 units per staged row of R (BK codes), and of L (BI codes)
const NB: u32 = ${NB}u;          // 16-column blocks
const BN: u32 = NB * 16u;
const LDW: u32 = BK / 4u + 4u;   // i32 words per staged row (padded against bank conflicts)
const THREADS: u32 = 128u;
const LU: u32 = BK * UPR / THREADS;                  // L's units per invocation
const RU: u32 = (BN * UPR + THREADS - 1u) / THREADS;  // R's units per invocation (the last one guarded)

var<workgroup> SL: array<i32, BK * LDW>;                 // L's tile: row m (of the step) * LDW + word of i
var<workgroup> SR: array<array<i32, 16u * LDW>, NB>;   // R's column block j: row n * LDW + word of m

fn tile_start(wid: vec3<u32>) -> u32 {
    return wid.x * BI;
}

fn reduction_start(wid: vec3<u32>) -> u32 {
    return wid.y * prm.chunk;
}

fn reduction_length() -> u32 {
    return prm.M;
}

fn p_base(wid: vec3<u32>, sg: u32) -> u32 {
    return (wid.y * prm.D + wid.x * BI + sg * 16u) * prm.N;
}

fn ld_left(u: u32, i0: u32, m0: u32) -> vec4<u32> {
    return L[((m0 + u / UPR) * prm.D + i0) / 16u + u % UPR];
}

fn ld_right(u: u32, m0: u32) -> vec4<u32> {
    let n = min(u / UPR, prm.N - 1u);
    return R[n * (prm.M / 16u) + m0 / 16u + u % UPR];
}

fn put_left(u: u32, v: vec4<u32>) {
    let o = (u / UPR) * LDW + (u % UPR) * 4u;
    let w = words(v);
    SL[o] = w.x;
    SL[o + 1u] = w.y;
    SL[o + 2u] = w.z;
    SL[o + 3u] = w.w;
}

fn put_right(u: u32, v: vec4<u32>) {
    let row = u / UPR;
    let o = (row % 16u) * LDW + (u % UPR) * 4u;
    let b = row / 16u;
    let w = words(v);
    SR[b][o] = w.x;
    SR[b][o + 1u] = w.y;
    SR[b][o + 2u] = w.z;
    SR[b][o + 3u] = w.w;
}
