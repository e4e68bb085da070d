// Tensor-core GEMM through Dawn's subgroup matrices: f16 operands, f32 accumulation.
//   C[M, P] (+)= alpha * A[M, R] . B[R, P]
// B is read from a weight W of shape [N, K] (ggml/gguf block layout) through decode4():
//   orientation "nt" (forward,    Y = X . W^T):  B[r, p] = W[p, r]   (R = K, P = N)
//   orientation "nn" (input grad, dX = dY . W):  B[r, p] = W[r, p]   (R = N, P = K)
// A is row-major [M, R] (row stride lda), f32 or f16 in memory; it is rounded to f16 while staged.
// A workgroup of SG_M x SG_N subgroups (32 invocations each) computes a BM x BN tile of C; each subgroup
// owns TM x TN result matrices of 16 x 16. BK reduction steps at a time are staged in workgroup memory as
// f16 (the weight is dequantized straight into its f16 tile); with PREFETCH the next step's global loads
// go into registers while the tensor cores work on the current one (two workgroup buffers).
// The result goes out through a small f32 workgroup scratch, 16 x 16 per subgroup at a time, so any M, P
// (M = 1 included), alpha and accumulate are handled in one bounds-checked epilogue.
// Dollar-brace placeholders are filled by gpu/codegen_tc.py. Its emulation mode swaps the subgroup-matrix
// builtins for plain WGSL functions (every invocation holds whole matrices) to test the indexing on any
// adapter with shader-f16, e.g. lavapipe.
${DIRECTIVES}

${DECODE}

struct Params {
    M: u32,
    P: u32,
    R: u32,
    K: u32,      // weight row length
    lda: u32,
    ldc: u32,
    a_off: u32,
    c_off: u32,
    alpha: f32,
    N: u32,      // weight rows
    _pad0: u32,
    _pad1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> A: array<${A_ELEM}>;
@group(0) @binding(2) var<storage, read> W: array<${W_ELEM}>;
@group(0) @binding(3) var<storage, read_write> C: array<f32>;

const SG_M: u32 = ${SG_M}u;         // subgroups along M
const TM: u32 = ${TM}u;             // 16 x 16 result matrices per subgroup along M
const TN: u32 = ${TN}u;             // ... along P
const BM: u32 = ${BM}u;
const BN: u32 = ${BN}u;
const BK: u32 = ${BK}u;
const THREADS: u32 = ${THREADS}u;
const NSG: u32 = ${NSG}u;           // subgroups per workgroup
const LDA_S: u32 = ${LDA_S}u;       // row stride of the staged A tile [BM][BK] (padded)
const LDB_S: u32 = ${LDB_S}u;       // row stride of the staged B tile: "nt" [BN][BK], "nn" [BK][BN]
const A_TILE: u32 = BM * LDA_S;
const B_TILE: u32 = ${B_TILE}u;

var<workgroup> As: array<f16, ${AS_LEN}>;
var<workgroup> Bs: array<f16, ${BS_LEN}>;
var<workgroup> Cs: array<f32, ${CS_LEN}>;   // one 16 x 16 f32 result per subgroup (epilogue)
${EMULATION}
${A_LOAD}

// A unit = 4 consecutive r of one row m of the A tile.
fn load_a(u: u32, m0: u32, r0: u32) -> vec4<f16> {
    let m = m0 + u / (BK / 4u);
    let r = r0 + (u % (BK / 4u)) * 4u;
    if (m < prm.M && r < prm.R) {
        return a4(m, r);
    }
    return vec4<f16>(0.0h);
}

fn store_a(u: u32, buf: u32, v: vec4<f16>) {
    let o = buf * A_TILE + (u / (BK / 4u)) * LDA_S + (u % (BK / 4u)) * 4u;
    As[o] = v.x;
    As[o + 1u] = v.y;
    As[o + 2u] = v.z;
    As[o + 3u] = v.w;
}

// "nt": a unit = W[n, k..k+3] (4 consecutive r of B column p = n), staged as Bs[n][k].
// "nn": a unit = W[r, p..p+3] (4 consecutive p of B row r), staged as Bs[r][p].
fn load_b(u: u32, p0: u32, r0: u32) -> vec4<f16> {
    ${LOAD_B}
}

fn store_b(u: u32, buf: u32, v: vec4<f16>) {
    let o = buf * B_TILE + ${STORE_B_OFFSET};
    Bs[o] = v.x;
    Bs[o + 1u] = v.y;
    Bs[o + 2u] = v.z;
    Bs[o + 3u] = v.w;
}

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
                        let v = Cs[s * 256u + row * 16u + col + c];
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
    @builtin(local_invocation_index) lid: u32,${SG_PARAM}
) {${SG_LET}
    let p0 = wg.x * BN;
    let m0 = wg.y * BM;
    let a_sg = (sg % SG_M) * (TM * 16u) * LDA_S;   // this subgroup's rows of the A tile
    let b_sg = ${B_SG};                            // ... and its columns of the B tile
${ACC_DECL}
${MAIN_LOOP}
    // Epilogue: every subgroup stores its matrix (i, j) to Cs, then all invocations write them out.
${EPILOGUE}
}
