// dB = s dY^T t on the integer tensor cores (gpu/ops/lora_db_i8.py), first pass: the i32 sums over one chunk of
// rows per workgroup row z, P[z, i, n] = sum over m in the chunk of L(m, i) R_n(m) (P: D rows of N per chunk);
// lora_sum_i8_finish.wgsl adds the chunks with their scales. L: the large operand's int8 codes [M, D], row m
// contiguous along i (dY sW as the input gradient's GEMM takes it; packed four per u32 word); R_n: row n of the thin
// operand's codes stored by columns ([N, M]: column n of u along the rows, lora_cols_i8.wgsl), each chunk of rows
// with its own scale per column. Workgroup: 4 subgroups of 16 outputs i each and all N = 16 NB columns. Per step
// BK rows m of the tile's BI codes of L and of the N rows of R are staged in workgroup memory as i32 words, the next
// step's loaded into registers meanwhile; each subgroup multiplies its 16 columns of L (left matrices loaded
// column-major: L^T) by the NB column blocks, BK / 32 integer MMAs each. ${COMPUTE_NOTE}
${DIRECTIVES}

struct Params {
    M: u32,        // rows of L and of R (a multiple of BK)
    D: u32,        // L's row length, the outputs i (a multiple of BI)
    N: u32,        // output columns, a multiple of 16, at most BN
    chunk: u32,    // rows per workgroup row z (a multiple of BK)
    ldl: u32,      // L's row stride, in vec4<u32> (16 codes)
    l_off: u32,    // L's first vec4
    _pad0: u32,
    _pad1: u32,
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

fn ld_l(u: u32, i0: u32, m0: u32) -> vec4<u32> {
    return L[prm.l_off + (m0 + u / UPR) * prm.ldl + i0 / 16u + u % UPR];
}

fn ld_r(u: u32, m0: u32) -> vec4<u32> {
    let n = min(u / UPR, prm.N - 1u);
    return R[n * (prm.M / 16u) + m0 / 16u + u % UPR];
}

// this invocation's units of L's tile rows from m0 (columns i0 ..) and of R's rows, into rl and rr
fn fetch(rl: ptr<function, array<vec4<u32>, LU>>, rr: ptr<function, array<vec4<u32>, RU>>, lid: u32, i0: u32,
         m0: u32) {
    for (var e = 0u; e < LU; e++) {
        (*rl)[e] = ld_l(lid + e * THREADS, i0, m0);
    }
    for (var e = 0u; e < RU; e++) {
        let u = lid + e * THREADS;
        if (u < BN * UPR) {
            (*rr)[e] = ld_r(u, m0);
        }
    }
}

fn put_l(u: u32, v: vec4<u32>) {
    let o = (u / UPR) * LDW + (u % UPR) * 4u;
    SL[o] = bitcast<i32>(v.x);
    SL[o + 1u] = bitcast<i32>(v.y);
    SL[o + 2u] = bitcast<i32>(v.z);
    SL[o + 3u] = bitcast<i32>(v.w);
}

fn put_r(u: u32, v: vec4<u32>) {
    let row = u / UPR;
    let o = (row % 16u) * LDW + (u % UPR) * 4u;
    let b = row / 16u;
    SR[b][o] = bitcast<i32>(v.x);
    SR[b][o + 1u] = bitcast<i32>(v.y);
    SR[b][o + 2u] = bitcast<i32>(v.z);
    SR[b][o + 3u] = bitcast<i32>(v.w);
}
${HELPERS}

@compute @workgroup_size(THREADS)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,${SG_PARAM}
) {${SG_LET}
    let i0 = wid.x * BI;
    let m0 = wid.y * prm.chunk;
    let steps = min(prm.chunk, prm.M - m0) / BK;
${ACC_DECL}
    var rl: array<vec4<u32>, LU>;   // this invocation's units of the next step, loaded ahead
    var rr: array<vec4<u32>, RU>;
    fetch(&rl, &rr, lid, i0, m0);
    for (var t = 0u; t < steps; t++) {
        workgroupBarrier();
        for (var e = 0u; e < LU; e++) {
            put_l(lid + e * THREADS, rl[e]);
        }
        for (var e = 0u; e < RU; e++) {
            let u = lid + e * THREADS;
            if (u < BN * UPR) {
                put_r(u, rr[e]);
            }
        }
        workgroupBarrier();
        if (t + 1u < steps) {
            fetch(&rl, &rr, lid, i0, m0 + (t + 1u) * BK);
        }
${COMPUTE}
    }
    let base = (wid.y * prm.D + i0 + sg * 16u) * prm.N;
${STORE}
}
