// Integer tensor-core GEMM through Dawn's subgroup matrices: int8 operands, i32 accumulation (16 x 16 x 32).
//   C[M, N] (+)= alpha * sum_c SA[m, c] * SW[n, c] * sum_{k in chunk c} A[m, k] * B[k, n]
// with B = W^T for a weight W [N, K] (orientation "nt", the forward: matmul_i8_rows.wgsl stages W's rows as A's) or
// B = W for W [K, N] (orientation "nn", the input gradient: matmul_i8_b_nn.wgsl; one chunk, SW a column scale).
// A [M, K] and W are int8 codes packed four per u32 word (little-endian), read 16 at a time (vec4<u32>); SA
// [M, K / chunk] and SW [N, K / chunk] their f32 scales (model/int8.py is the numpy twin).
// A workgroup of SG_M x SG_N subgroups computes a BM x BN tile of C; each subgroup owns TM x TN i32 result
// matrices. BK codes of every row are staged per step in workgroup memory (i32 words), the next step's loads
// held in registers while the tensor cores work: one buffer and two barriers a step, or (STAGES 2) two
// buffers, the registers stored into the idle one after the products, one barrier a step. Subgroup matrices are
// opaque (no per-row or per-column scaling in registers), so at the end of every chunk of K (CHUNKED) or only
// at the end (one chunk: per-row scales) each result matrix goes through the subgroup's scratch Cs, FM at a
// time; each invocation scales its 8 elements (one column, every other row) by SA * SW into f32 registers, and the
// i32 matrix starts again from zero. Rows past M or N are clamped on load and never written. An accumulating
// epilogue reads the C values it adds onto a few result matrices ahead (old8), their latency behind the scaling;
// the residual variant reads them from R (C = R + alpha * ...: a block's residual add in its projection).
// The LoRA variant adds s * T . L to each value as it is written, computed per result matrix on the f16 tensor cores
// (matmul_i8_lora.wgsl): the forward's LoRA expansion (and the input gradient's) in the epilogue instead of a pass
// of its own over C.
// The "direct" timing probe (gpu/codegen_i8.py) stages nothing: A and W bound as i32 words, each subgroup loads its
// matrices straight from storage.
// K must be a multiple of BK and of the chunk (gpu/ops/matmul_i8.py checks). Dollar-brace placeholders are
// filled by gpu/codegen_i8.py, whose emulation mode swaps the subgroup-matrix builtins for plain WGSL
// (matmul_i8_emulation.wgsl) to test the indexing on adapters without them.
${DIRECTIVES}

struct I8Params {
    M: u32,
    N: u32,
    K: u32,
    lda: u32,      // A row stride, in vec4<u32> (16 codes)
    ldw: u32,      // W row stride, in vec4<u32>
    a_off: u32,    // first vec4 of A
    ldc: u32,
    c_off: u32,
    alpha: f32,
    chunks: u32,   // scales per row: K / chunk
    spc: u32,      // staged steps per chunk: chunk / BK
    lr: u32,       // LoRA variant: T16's row length (the rank rounded up to 16)
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
    _pad3: u32,
};

@group(0) @binding(0) var<uniform> prm: I8Params;
@group(0) @binding(1) var<storage, read> A: array<${OPERAND}>;
@group(0) @binding(2) var<storage, read> W: array<${OPERAND}>;
@group(0) @binding(3) var<storage, read> SA: array<f32>;
@group(0) @binding(4) var<storage, read> SW: array<f32>;
@group(0) @binding(5) var<storage, read_write> C: array<f32>;
${LORA_BINDINGS}
${RESIDUAL_BINDING}

const TM: u32 = ${TM}u;
const TN: u32 = ${TN}u;
const BM: u32 = ${BM}u;
const BN: u32 = ${BN}u;
const BK: u32 = ${BK}u;
const THREADS: u32 = ${THREADS}u;
const NSG: u32 = ${NSG}u;
const SG_M: u32 = ${SG_M}u;
const SG_N: u32 = ${SG_N}u;
const GROUP_M: u32 = ${GROUP_M}u;   // workgroup rows per raster group (L2 reuse), 0: plain order
const UPR: u32 = BK / 16u;          // staged vec4 units per row
const A_RB: u32 = BM / SG_M;        // rows per A block (one per subgroup row)
const B_RB: u32 = BN / SG_N;        // rows of W per B block (one per subgroup column)
const LDW: u32 = ${LDW}u;           // staged row stride in words (BK / 4 + padding)

${STAGE_DECLS}
${CS_DECL}
${EMULATION}

${A_STAGING}
${B_STAGING}
${RASTER}

// SA of this invocation's 8 rows of a result matrix whose first row is m (m, m + 2, ..., m + 14; clamped)
fn sa8(m: u32, c: u32) -> array<f32, 8> {
    var s: array<f32, 8>;
    for (var e = 0u; e < 8u; e++) {
        s[e] = SA[min(m + 2u * e, prm.M - 1u) * prm.chunks + c];
    }
    return s;
}

// this invocation's 8 i32 results of the subgroup's scratch matrix f (elements lane, lane + 32, ...: the warp
// reads 32 consecutive words and writes two 16-column rows of C per element), scaled
fn scaled8(sg: u32, f: u32, lane: u32, sa: array<f32, 8>, sw: f32) -> array<f32, 8> {
    var v: array<f32, 8>;
    for (var e = 0u; e < 8u; e++) {
        v[e] = f32(${CS_ARR}[${CS_BASE}f * 256u + e * 32u + lane]) * (sa[e] * sw);
    }
    return v;
}

fn add8(a: array<f32, 8>, b: array<f32, 8>) -> array<f32, 8> {
    var v: array<f32, 8>;
    for (var e = 0u; e < 8u; e++) {
        v[e] = a[e] + b[e];
    }
    return v;
}

// C's values (R's, the residual variant's) at rows m, m + 2, ..., m + 14 of column n (0 outside): what an
// accumulating epilogue adds onto, read before the result matrices they belong to come out of Cs (I8Config.old_ahead
// groups ahead)
fn old8(m: u32, n: u32) -> array<f32, 8> {
    var o: array<f32, 8>;
    if (n < prm.N) {
        for (var e = 0u; e < 8u; e++) {
            let row = m + 2u * e;
            if (row < prm.M) {
                o[e] = ${OLD_SRC}[prm.c_off + row * prm.ldc + n];
            }
        }
    }
    return o;
}

// rows m, m + 2, ..., m + 14 of column n of C (bounds-checked)
fn write8(m: u32, n: u32, v: array<f32, 8>${WRITE8_LORA}${WRITE8_OLD}) {
    if (n >= prm.N) {
        return;
    }
    for (var e = 0u; e < 8u; e++) {
        let row = m + 2u * e;
        if (row < prm.M) {
            let i = prm.c_off + row * prm.ldc + n;
            ${STORE_EXPR}
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
    let tile_n = tile.y;
    let m0 = tile_m * BM;
    let n0 = tile_n * BN;
    let sg_m = sg % SG_M;
    let sg_n = sg / SG_M;
    let row = lane / 16u;                // this invocation's first row and its column in each 16 x 16 result
    let col = lane % 16u;
    let ms = m0 + sg_m * (TM * 16u) + row;
    let ns = n0 + sg_n * (TN * 16u) + col;
    let steps = prm.K / BK;
${DECLS}
${MAIN_LOOP}
${EPILOGUE}
}
