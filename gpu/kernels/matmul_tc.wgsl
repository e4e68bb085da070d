// Tensor-core GEMM through Dawn's subgroup matrices: f16 operands, f32 accumulation.
//   C[M, P] (+)= alpha * A[M, R] . B[R, P]
// B is read from a weight W of shape [N, K] (ggml/gguf block layout) through w_vec8 (8 consecutive weights
// of a row: the type's own loader, matmul_tc_w_<type>.wgsl, or two decode4 calls) and decode4 (checked loaders):
//   orientation "nt" (forward,    Y = X . W^T):  B[r, p] = W[p, r]   (R = K, P = N)
//   orientation "nn" (input grad, dX = dY . W):  B[r, p] = W[r, p]   (R = N, P = K)
// A is row-major [M, R] (row stride lda), f32 or f16 in memory; it is rounded to f16 while staged.
//
// A workgroup of SG_M x SG_N subgroups (32 invocations each) computes a BM x BN tile of C; each subgroup
// owns TM x TN result matrices of 16 x 16. BK reduction steps at a time are staged in workgroup memory as
// f16 (the weight is dequantized straight into its f16 tile), in units of V consecutive elements: each
// invocation issues all of its global loads for a step before any of its stores. With `split` tiles each
// subgroup's rows of A (and output columns of B) live in an array of their own, so every matrix load has a
// constant offset: Dawn's robustness then needs no bounds predicate around it (it wraps each load with a
// run-time offset in a branch and a local variable).
// Bounds without branches: A rows and weight rows past the matrix are clamped to the last one (they only
// feed rows / columns of C that are never written); the reduction tail (R % BK) is staged by the checked
// `_edge` loaders, which zero what lies past R. Pipelining (gpu/codegen_tc.py's TCConfig.stages):
//   0: load and store each step in place (2 barriers a step);
//   1: the next step's loads go to registers while the tensor cores work on this one (2 barriers);
//   2: as 1 with two workgroup buffers (1 barrier a step).
// Epilogue: interior workgroups with alpha = 1 store their results straight to C (accumulate loads them
// first); the rest go through a small f32 scratch, 16 x 16 per subgroup at a time, bounds-checked.
// Dollar-brace placeholders are filled by gpu/codegen_tc.py. Its emulation mode swaps the subgroup-matrix
// builtins for plain WGSL (matmul_tc_emulation.wgsl) to test the indexing on any adapter with shader-f16.
${DIRECTIVES}

${DECODE}

${PARAMS}
@group(0) @binding(1) var<storage, read> A: array<${A_ELEM}>;
@group(0) @binding(2) var<storage, read> W: array<${W_ELEM}>;
@group(0) @binding(3) var<storage, read_write> C: array<f32>;

const SG_M: u32 = ${SG_M}u;         // subgroups along M
const TM: u32 = ${TM}u;             // 16 x 16 result matrices per subgroup along M
const TN: u32 = ${TN}u;             // ... along P
const BM: u32 = ${BM}u;
const BN: u32 = ${BN}u;
const BK: u32 = ${BK}u;
const V: u32 = ${V}u;               // elements per staging unit
const THREADS: u32 = ${THREADS}u;
const NSG: u32 = ${NSG}u;           // subgroups per workgroup
const GROUP_M: u32 = ${GROUP_M}u;   // workgroup rows per raster group (L2 reuse), 0: plain order
const A_NB: u32 = ${A_NB}u;         // blocks (arrays) of the A tile per buffer
const A_RB: u32 = BM / A_NB;        // rows per A block
const LDA_S: u32 = ${LDA_S}u;       // row stride of a staged A block [A_RB][BK] (padded)
const B_NB: u32 = ${B_NB}u;         // blocks of the B tile per buffer
const B_RB: u32 = BN / B_NB;        // output columns per B block
const LDB_S: u32 = ${LDB_S}u;       // row stride of a staged B block: "nt" [B_RB][BK], "nn" [BK][B_RB]
const AU_ROW: u32 = BK / V;         // staging units per row of the A tile
const BU_ROW: u32 = ${BU_ROW}u;     // ... of the B tile

var<workgroup> As: array<array<f16, ${A_BLK}>, ${A_BLOCKS}>;   // [buffer * A_NB + block]
var<workgroup> Bs: array<array<f16, ${B_BLK}>, ${B_BLOCKS}>;
var<workgroup> Cs: array<array<f32, 256>, NSG>;   // one 16 x 16 f32 result per subgroup (checked epilogue)

// 8 consecutive f16 (a staging unit of V = 8)
struct H8 {
    lo: vec4<f16>,
    hi: vec4<f16>,
}
${EMULATION}
${A_ACCESS}

// f16 of A[i] when ok, else 0 (never reads past R)
fn a_chk(i: u32, ok: bool) -> f16 {
    if (ok) {
        return a_at(i);
    }
    return 0.0h;
}

// W[n, k..k+3] as f16 when ok, else 0
fn w4_chk(n: u32, k: u32, ok: bool) -> vec4<f16> {
    if (ok) {
        return vec4<f16>(decode4(n, k, prm.K));
    }
    return vec4<f16>(0.0h);
}

${STAGING_FNS}

${RASTER}

// Write the 16 x 16 result of every subgroup (staged in Cs) for its matrix (i, j) to C, bounds-checked.
fn write_out(lid: u32, m0: u32, p0: u32, i: u32, j: u32) {
    for (var e = 0u; e < (NSG * 64u + THREADS - 1u) / THREADS; e++) {
        let u = lid + e * THREADS;           // unit = 4 consecutive columns of one row
        if (u < NSG * 64u) {
            let s = u / 64u;
            let row = (u % 64u) / 4u;
            let col = (u % 4u) * 4u;
            let m = m0 + (s % SG_M) * (TM * 16u) + i * 16u + row;
            let p = p0 + (s / SG_M) * (TN * 16u) + j * 16u + col;
            if (m < prm.M) {
                let base = prm.c_off + m * prm.ldc;
                for (var c = 0u; c < 4u; c++) {
                    if (p + c < prm.P) {
                        let v = Cs[s][row * 16u + col + c];
                        ${STORE_EXPR}
                    }
                }
            }
        }
    }
}

@compute @workgroup_size(${THREADS})
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,${SG_PARAM}
) {${SG_LET}
    let tile = raster(wg, nwg);
    let tile_m = tile.x;
    let tile_p = tile.y;
    let p0 = tile_p * BN;
    let m0 = tile_m * BM;
    let sg_m = sg % SG_M;                          // this subgroup's rows of the A tile
    let sg_n = sg / SG_M;                          // ... and its columns of the B tile
${SG_OFFSETS}
    let c_sg = prm.c_off + (m0 + sg_m * (TM * 16u)) * prm.ldc + p0 + sg_n * (TN * 16u);
    let full = prm.R / BK;                         // steps without a reduction tail
    let steps = (prm.R + BK - 1u) / BK;
    // Interior tile, alpha = 1, 16-byte aligned rows: results go straight to C.
    let direct = ${DIRECT} && m0 + BM <= prm.M && p0 + BN <= prm.P && prm.alpha == 1.0
        && prm.ldc % 4u == 0u && prm.c_off % 4u == 0u;
${ACC_DECL}
${MAIN_LOOP}
${EPILOGUE}
}
