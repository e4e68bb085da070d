// LoRA's thin product t = x A^T on the integer tensor cores (gpu/ops/lora_i8.py), first pass: the i32 sums of
// one chunk of K per workgroup row z, P[z, m, n] = sum over k in the chunk of X(m, k) A_n(k), into a scratch of
// MP rows per chunk (M rounded up to BM); lora_thin_i8_finish.wgsl adds the chunks and applies the scales.
// X: the projection's own int8 operand (codes [M, K] packed four per u32 word, rotated, one scale per row);
// A_n: column n is row n % r of the A of column group n / r (each adapter's int8 codes [r, K], rotated like the
// weight codes, at its own offset in Acodes: several adapters sharing x in one dispatch).
// Workgroup: 4 subgroups of 16 rows of x each and all N = 16 NB columns. Per step BK codes of each of the tile's
// rows of x and of the N rows of A are staged in workgroup memory as i32 words (row-major, padded rows), the next
// step's loaded into registers meanwhile; each subgroup multiplies its 16 rows by the NB column blocks, BK / 32
// integer MMAs each. ${COMPUTE_NOTE}
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
const XU: u32 = BM * UPR / THREADS;                  // x's units per invocation
const AU: u32 = (BN * UPR + THREADS - 1u) / THREADS;  // A's units per invocation (the last one guarded)

var<workgroup> S: array<array<i32, 16u * LDW>, 4u + NB>;   // blocks 0-3: x's rows by subgroup; 4 + j: A's column
                                                          // block j ([row or column * LDW + word])

fn ld_x(u: u32, m0: u32, k0: u32) -> vec4<u32> {
    let row = min(m0 + u / UPR, prm.M - 1u);
    return X[prm.x_off + row * prm.ldx + k0 / 16u + u % UPR];
}

fn ld_a(u: u32, k0: u32) -> vec4<u32> {
    let n = min(u / UPR, prm.N - 1u);
    return Acodes[prm.a_go[n / prm.r] + (n % prm.r) * (prm.K / 16u) + k0 / 16u + u % UPR];
}

// this invocation's units of x's tile rows from m0 and of the A rows, at codes k0 .. k0 + BK, into rx and ra
fn fetch(rx: ptr<function, array<vec4<u32>, XU>>, ra: ptr<function, array<vec4<u32>, AU>>, lid: u32, m0: u32,
         k0: u32) {
    for (var e = 0u; e < XU; e++) {
        (*rx)[e] = ld_x(lid + e * THREADS, m0, k0);
    }
    for (var e = 0u; e < AU; e++) {
        let u = lid + e * THREADS;
        if (u < BN * UPR) {
            (*ra)[e] = ld_a(u, k0);
        }
    }
}

// unit u (row u / UPR, words 4 (u % UPR) ..) of the operand whose blocks start at block b0 of S
fn put(b0: u32, u: u32, v: vec4<u32>) {
    let row = u / UPR;
    let o = (row % 16u) * LDW + (u % UPR) * 4u;
    let b = b0 + row / 16u;
    S[b][o] = bitcast<i32>(v.x);
    S[b][o + 1u] = bitcast<i32>(v.y);
    S[b][o + 2u] = bitcast<i32>(v.z);
    S[b][o + 3u] = bitcast<i32>(v.w);
}
${HELPERS}

@compute @workgroup_size(THREADS)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,${SG_PARAM}
) {${SG_LET}
    let m0 = wid.x * BM;
    let k0 = wid.y * prm.chunk;
    let steps = min(prm.chunk, prm.K - k0) / BK;
${ACC_DECL}
    var rx: array<vec4<u32>, XU>;   // this invocation's units of the next step, loaded ahead
    var ra: array<vec4<u32>, AU>;
    fetch(&rx, &ra, lid, m0, k0);
    for (var t = 0u; t < steps; t++) {
        workgroupBarrier();
        for (var e = 0u; e < XU; e++) {
            put(0u, lid + e * THREADS, rx[e]);
        }
        for (var e = 0u; e < AU; e++) {
            let u = lid + e * THREADS;
            if (u < BN * UPR) {
                put(4u, u, ra[e]);
            }
        }
        workgroupBarrier();
        if (t + 1u < steps) {
            fetch(&rx, &ra, lid, m0, k0 + (t + 1u) * BK);
        }
${COMPUTE}
    }
    let base = (wid.y * prm.MP + m0 + sg * 16u) * prm.N;
${STORE}
}
