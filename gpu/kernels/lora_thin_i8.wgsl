// LoRA's thin product t = x A^T on the integer tensor cores (gpu/ops/lora_i8.py), first pass: the i32 sums of
// one chunk of K per workgroup row z, P[z, m, n] = sum over k in the chunk of X(m, k) A_n(k), into a scratch of
// MP rows per chunk (M rounded up to BM); lora_thin_i8_finish.wgsl adds the chunks and applies the scales.
// X: the projection's own int8 operand (codes [M, K] packed four per u32 word, rotated, one scale per row);
// A_n: column n is row n % r of the A of column group n / r (each adapter's int8 codes [r, K], rotated like the
// weight codes, at its own offset in Acodes: several adapters sharing x in one dispatch).
// Workgroup: 4 subgroups of 16 rows of x each and all N = 16 NB columns. Per step BK codes of each of the tile's
// rows of x and of the N rows of A are staged in workgroup memory as i32 words (row-major, padded rows), the next
// step's loaded into registers meanwhile (lora_i8_steps.wgsl); each subgroup multiplies its 16 rows by the NB
// column blocks, BK / 32 integer MMAs each. ${COMPUTE_NOTE}
${DIRECTIVES}

struct Params {
    M: u32,
    N: u32,        // output columns: groups x r, a multiple of 16, at most BN
    K: u32,        // codes per row of x and of A (a multiple of BK)
    chunk: u32,    // codes per workgroup row z (a multiple of BK)
    ldx: u32,      // x's row stride, in vec4<u32> (16 codes)
    x_off: u32,    // x's first vec4
    r: u32,        // columns per group (rows of one adapter's A)
    MP: u32,       // rows of P per chunk (M rounded up to BM)
    a_go: vec4<u32>,   // per group: the first vec4 of its A's codes in Acodes (rows of K / 16 vec4s)
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> X: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> Acodes: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> P: array<i32>;

const BM: u32 = 64u;             // rows of x per workgroup (16 per subgroup)
const BK: u32 = 64u;             // codes per step
const UPR: u32 = BK / 16u;       // vec4 units per staged row
const NB: u32 = ${NB}u;          // 16-column blocks
const BN: u32 = NB * 16u;
const LDW: u32 = BK / 4u + 4u;   // i32 words per staged row (padded against bank conflicts)
const THREADS: u32 = 128u;
const LU: u32 = BM * UPR / THREADS;                  // x's units per invocation
const RU: u32 = (BN * UPR + THREADS - 1u) / THREADS;  // A's units per invocation (the last one guarded)

var<workgroup> S: array<array<i32, 16u * LDW>, 4u + NB>;   // blocks 0-3: x's rows by subgroup; 4 + j: A's column
                                                          // block j ([row or column * LDW + word])

fn tile_start(wid: vec3<u32>) -> u32 {
    return wid.x * BM;
}

fn reduction_start(wid: vec3<u32>) -> u32 {
    return wid.y * prm.chunk;
}

fn reduction_length() -> u32 {
    return prm.K;
}

fn p_base(wid: vec3<u32>, sg: u32) -> u32 {
    return (wid.y * prm.MP + wid.x * BM + sg * 16u) * prm.N;
}

fn ld_left(u: u32, m0: u32, k0: u32) -> vec4<u32> {
    let row = min(m0 + u / UPR, prm.M - 1u);
    return X[prm.x_off + row * prm.ldx + k0 / 16u + u % UPR];
}

fn ld_right(u: u32, k0: u32) -> vec4<u32> {
    let n = min(u / UPR, prm.N - 1u);
    return Acodes[prm.a_go[n / prm.r] + (n % prm.r) * (prm.K / 16u) + k0 / 16u + u % UPR];
}

// unit u (row u / UPR, words 4 (u % UPR) ..) of the operand whose blocks start at block b0 of S
fn put(b0: u32, u: u32, v: vec4<u32>) {
    let row = u / UPR;
    let o = (row % 16u) * LDW + (u % UPR) * 4u;
    let b = b0 + row / 16u;
    let w = words(v);
    S[b][o] = w.x;
    S[b][o + 1u] = w.y;
    S[b][o + 2u] = w.z;
    S[b][o + 3u] = w.w;
}

fn put_left(u: u32, v: vec4<u32>) {
    put(0u, u, v);
}

fn put_right(u: u32, v: vec4<u32>) {
    put(4u, u, v);
}
