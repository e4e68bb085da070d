// Register-blocked GEMM with the weight decoded in-kernel (f32 arithmetic, f32 accumulation).
//   C[M, P] (+)= alpha * A[M, R] . B[R, P]
// B is read from a weight W of shape [N, K] (N rows of K, ggml/gguf block layout) through decode4():
//   orientation "nt" (forward,    Y = X . W^T):  B[r, p] = W[p, r]   (R = K, P = N)
//   orientation "nn" (input grad, dX = dY . W):  B[r, p] = W[r, p]   (R = N, P = K)
// A is row-major [M, R] with row stride lda, or (TRANS_A) stored as [R, M] with row stride lda.
// The workgroup computes a BM x BP tile of C, BR reduction steps at a time staged in workgroup memory
// (W is decoded while it is staged); each of the THREADS threads holds TM x TN outputs in vec4 registers.
// Dollar-brace placeholders are filled by gpu/codegen.py.

${DECODE}

${PARAMS}
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> W: array<${W_ELEM}>;
@group(0) @binding(3) var<storage, read_write> C: array<f32>;

const BM: u32 = ${BM}u;
const BP: u32 = ${BP}u;
const BR: u32 = ${BR}u;
const TX: u32 = ${TX}u;          // threads along P
const TY: u32 = ${TY}u;          // threads along M
const THREADS: u32 = ${THREADS}u;
const BMV: u32 = BM / 4u;        // vec4s per staged A row
const BPV: u32 = BP / 4u;        // vec4s per staged B row

var<workgroup> As: array<vec4<f32>, ${AS_LEN}>;   // As[r * BMV + m / 4] = A[m0 + m .. +3, r0 + r]
var<workgroup> Bs: array<vec4<f32>, ${BS_LEN}>;   // Bs[r * BPV + p / 4] = B[r0 + r, p0 + p .. +3]

fn a_at(m: u32, r: u32) -> f32 {
    if (m < prm.M && r < prm.R) {
        return A[prm.a_off + ${A_INDEX}];
    }
    return 0.0;
}

// A tile, one vec4 (4 consecutive m at one r) per unit.
fn stage_a(lid: u32, m0: u32, r0: u32) {
    const UNITS: u32 = BR * BMV;
    for (var i = 0u; i < (UNITS + THREADS - 1u) / THREADS; i++) {
        let u = lid + i * THREADS;
        if (u < UNITS) {
            let rl = ${A_UNIT_R};
            let mv = ${A_UNIT_M};
            let m = m0 + mv * 4u;
            let r = r0 + rl;
            As[rl * BMV + mv] = vec4<f32>(a_at(m, r), a_at(m + 1u, r), a_at(m + 2u, r), a_at(m + 3u, r));
        }
    }
}

fn w_at4(n: u32, k: u32) -> vec4<f32> {
    if (n < prm.N && k < prm.K) {
        return decode4(n, k, prm.K);
    }
    return vec4<f32>(0.0);
}

// "nt": B[r, p] = W[p, r]. A unit decodes a 4 x 4 block (4 rows n = p, 4 consecutive k = r) and stores
// it transposed as 4 vec4s.
fn stage_b_nt(lid: u32, p0: u32, r0: u32) {
    const UNITS: u32 = (BR / 4u) * BPV;
    for (var i = 0u; i < (UNITS + THREADS - 1u) / THREADS; i++) {
        let u = lid + i * THREADS;
        if (u < UNITS) {
            let rv = u % (BR / 4u);
            let pv = u / (BR / 4u);
            let n = p0 + pv * 4u;
            let k = r0 + rv * 4u;
            let w0 = w_at4(n, k);
            let w1 = w_at4(n + 1u, k);
            let w2 = w_at4(n + 2u, k);
            let w3 = w_at4(n + 3u, k);
            let o = rv * 4u * BPV + pv;
            Bs[o] = vec4<f32>(w0.x, w1.x, w2.x, w3.x);
            Bs[o + BPV] = vec4<f32>(w0.y, w1.y, w2.y, w3.y);
            Bs[o + 2u * BPV] = vec4<f32>(w0.z, w1.z, w2.z, w3.z);
            Bs[o + 3u * BPV] = vec4<f32>(w0.w, w1.w, w2.w, w3.w);
        }
    }
}

// "nn": B[r, p] = W[r, p]. A unit decodes 4 consecutive k = p of one row n = r.
fn stage_b_nn(lid: u32, p0: u32, r0: u32) {
    const UNITS: u32 = BR * BPV;
    for (var i = 0u; i < (UNITS + THREADS - 1u) / THREADS; i++) {
        let u = lid + i * THREADS;
        if (u < UNITS) {
            let pv = u % BPV;
            let rl = u / BPV;
            Bs[rl * BPV + pv] = w_at4(r0 + rl, p0 + pv * 4u);
        }
    }
}

fn store4(m: u32, p: u32, v: vec4<f32>) {
    if (m >= prm.M) {
        return;
    }
    let row = prm.c_off + m * prm.ldc;
    for (var e = 0u; e < 4u; e++) {
        if (p + e < prm.P) {
            ${STORE_EXPR}
        }
    }
}

@compute @workgroup_size(${THREADS})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let tx = lid % TX;
    let ty = lid / TX;
    let p0 = wg.x * BP;
    let m0 = wg.y * BM;
${ACC_DECL}
    for (var r0 = 0u; r0 < prm.R; r0 += BR) {
        stage_a(lid, m0, r0);
        ${STAGE_B}(lid, p0, r0);
        workgroupBarrier();
${COMPUTE}
        workgroupBarrier();
    }
${STORE}
}
