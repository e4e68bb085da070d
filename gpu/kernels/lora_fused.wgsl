// A LoRA product pair in one dispatch (gpu/ops/lora_fused.py). One workgroup owns BM = 16 token rows m0 .. m0 + 15:
//   phase 1 (reduction): T[m, j] = alpha1 * sum_k X[m, k] W1(k, j)        (j < R; the whole K in this workgroup)
//   phase 2 (expansion): Y[m, n] = Y[m, n] + alpha2 * sum_j T[m, j] W2(j, n)   (every n < N)
// with W1(k, j) = W1[k * w1_sk + j * w1_sj] and W2(j, n) = W2[j * w2_sj + n * w2_sn]. LoRA's forward: X = x,
// W1 = A^T, T = t, W2 = B^T, Y = y (alpha1 = 1, alpha2 = s); its backward's dt = s dy B, dx += dt A: X = dy,
// W1 = B, T = dt, W2 = A (alpha1 = s, alpha2 = 1). The block of T stays in workgroup memory (Ts) between the
// phases, zero beyond R ranks (rank bucket RB >= R).
// Phase 1: BK reduction steps of X [BM, BK] and W1 [RB, BK] are staged per tile, loaded along each operand's
// contiguous axis (w1_kfast) so the loads coalesce, stored k-contiguous as vec4s (rows padded by one vec4);
// each thread owns a 4 x 4 micro tile (rows mq + MT i, ranks 4 jq + c) and one of KG reduction lanes (4-step
// chunks kg, kg + KG, ... of each tile); the lanes' sums are then added in a fixed binary tree through
// workgroup memory. Phase 2: column blocks of NB, W2 [RB, NB] staged per block (rows padded by one float); each
// thread owns a column and RPT2 rows (g + G2 i), its sum over ranks in ascending order. Loads run DEPTH steps
// (blocks) ahead in register sets (gpu/codegen_lora_fused.py writes them out). Every sum has a fixed order:
// reproducible run to run, no atomics.

struct Params {
    M: u32,
    K: u32,
    N: u32,
    R: u32,
    w1_sk: u32,
    w1_sj: u32,
    w1_kfast: u32,
    w2_sj: u32,
    w2_sn: u32,
    w2_nfast: u32,
    alpha1: f32,
    alpha2: f32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> W1: array<f32>;
@group(0) @binding(3) var<storage, read> W2: array<f32>;
@group(0) @binding(4) var<storage, read_write> T: array<f32>;
@group(0) @binding(5) var<storage, read_write> Y: array<f32>;

const BM: u32 = 16u;
const THREADS: u32 = 256u;
const RB: u32 = ${RB}u;
const BK: u32 = ${BK}u;
const KG: u32 = ${KG}u;      // reduction lanes per micro tile
const CPK: u32 = ${CPK}u;    // 4-step chunks per lane per staged tile
const SX: u32 = ${SX}u;      // padded row stride (vec4) of staged X and W1
const NB: u32 = ${NB}u;      // expansion columns per block
const G2: u32 = ${G2}u;      // expansion row groups
const JT: u32 = RB / 4u;
const MT: u32 = BM / 4u;
const TILES: u32 = MT * JT;
const W0: u32 = BM * SX;     // staged W1 follows staged X in S
const SN: u32 = NB + 1u;     // padded row stride (floats) of staged W2
const DEPTH_REDUCE: u32 = ${DEPTH_REDUCE}u;
const DEPTH_EXPAND: u32 = ${DEPTH_EXPAND}u;

var<workgroup> S: array<vec4<f32>, ${S_LEN}>;   // staged tiles, then the lane sums, then staged W2
var<workgroup> Ts: array<vec4<f32>, BM * JT>;   // Ts[row * JT + q] = T(m0 + row, 4 q .. 4 q + 3)
var<private> acc0: vec4<f32>;
var<private> acc1: vec4<f32>;
var<private> acc2: vec4<f32>;
var<private> acc3: vec4<f32>;
${PRIVATE_EXPAND}

fn load_x(u: u32, m0: u32, k0: u32) -> f32 {
    let m = m0 + u / BK;
    let k = k0 + u % BK;
    if (m < prm.M && k < prm.K) {
        return X[m * prm.K + k];
    }
    return 0.0;
}

fn stage_x(u: u32, v: f32) {
    let k = u % BK;
    S[(u / BK) * SX + k / 4u][k % 4u] = v;
}

// (k, j) of W1 staging unit u: k fastest when W1 is contiguous along k, else j fastest.
fn w1_unit(u: u32) -> vec2<u32> {
    if (prm.w1_kfast != 0u) {
        return vec2<u32>(u % BK, u / BK);
    }
    return vec2<u32>(u / RB, u % RB);
}

fn load_w1(u: u32, k0: u32) -> f32 {
    let kj = w1_unit(u);
    let k = k0 + kj.x;
    if (kj.y < prm.R && k < prm.K) {
        return W1[k * prm.w1_sk + kj.y * prm.w1_sj];
    }
    return 0.0;
}

fn stage_w1(u: u32, v: f32) {
    let kj = w1_unit(u);
    S[W0 + kj.y * SX + kj.x / 4u][kj.x % 4u] = v;
}

// This thread's lane of the staged tile: chunks kg + KG cc of its 4 x 4 micro tile.
fn reduce_tile(kg: u32, mq: u32, jq: u32) {
    for (var cc = 0u; cc < CPK; cc++) {
        let kc = kg + KG * cc;
        let x0 = S[mq * SX + kc];
        let x1 = S[(mq + MT) * SX + kc];
        let x2 = S[(mq + 2u * MT) * SX + kc];
        let x3 = S[(mq + 3u * MT) * SX + kc];
        let j = W0 + 4u * jq * SX + kc;
        let w0 = S[j];
        let w1 = S[j + SX];
        let w2 = S[j + 2u * SX];
        let w3 = S[j + 3u * SX];
        acc0 += vec4<f32>(dot(x0, w0), dot(x0, w1), dot(x0, w2), dot(x0, w3));
        acc1 += vec4<f32>(dot(x1, w0), dot(x1, w1), dot(x1, w2), dot(x1, w3));
        acc2 += vec4<f32>(dot(x2, w0), dot(x2, w1), dot(x2, w2), dot(x2, w3));
        acc3 += vec4<f32>(dot(x3, w0), dot(x3, w1), dot(x3, w2), dot(x3, w3));
    }
}

// T(m0 + row, 4 jq .. 4 jq + 3) = t: into Ts (all of it, zeros beyond M and R) and into T (within M and R).
fn put_t(m0: u32, row: u32, jq: u32, t: vec4<f32>) {
    Ts[row * JT + jq] = t;
    let m = m0 + row;
    if (m < prm.M) {
        for (var c = 0u; c < 4u; c++) {
            let j = 4u * jq + c;
            if (j < prm.R) {
                T[m * prm.R + j] = t[c];
            }
        }
    }
}

// (j, n) of W2 staging unit u: n fastest when W2 is contiguous along n, else j fastest.
fn w2_unit(u: u32) -> vec2<u32> {
    if (prm.w2_nfast != 0u) {
        return vec2<u32>(u / NB, u % NB);
    }
    return vec2<u32>(u % RB, u / RB);
}

fn load_w2(u: u32, block: u32) -> f32 {
    let jn = w2_unit(u);
    let n = block * NB + jn.y;
    if (jn.x < prm.R && n < prm.N) {
        return W2[jn.x * prm.w2_sj + n * prm.w2_sn];
    }
    return 0.0;
}

fn stage_w2(u: u32, v: f32) {
    let jn = w2_unit(u);
    let f = jn.x * SN + jn.y;
    S[f / 4u][f % 4u] = v;
}

fn w2_at(j: u32, cn: u32) -> f32 {
    let f = j * SN + cn;
    return S[f / 4u][f % 4u];
}

fn load_y(m: u32, n: u32) -> f32 {
    if (m < prm.M && n < prm.N) {
        return Y[m * prm.N + n];
    }
    return 0.0;
}

fn store_y(m: u32, n: u32, v: f32) {
    if (m < prm.M && n < prm.N) {
        Y[m * prm.N + n] = v;
    }
}

// e_i = sum_j T(m0 + g + G2 i, j) W2(j, column cn of the staged block), j ascending in 4-rank steps.
fn expand_block(g: u32, cn: u32) {
    ${ZERO_EXPAND}
    for (var q = 0u; q < JT; q++) {
        let w = vec4<f32>(w2_at(4u * q, cn), w2_at(4u * q + 1u, cn), w2_at(4u * q + 2u, cn), w2_at(4u * q + 3u, cn));
        ${EXPAND_TERMS}
    }
}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let m0 = wid.x * BM;
    let jq = l % JT;
    let mq = (l / JT) % MT;
    let kg = l / TILES;
    acc0 = vec4<f32>(0.0);
    acc1 = vec4<f32>(0.0);
    acc2 = vec4<f32>(0.0);
    acc3 = vec4<f32>(0.0);
    // phase 1: the reduction over K, DEPTH_REDUCE staged tiles of loads in flight
    let n_steps = (prm.K + BK - 1u) / BK;
    ${DECLARE_REDUCE}
    ${PROLOGUE_REDUCE}
    for (var s = 0u; s < n_steps; s += DEPTH_REDUCE) {
        ${BODY_REDUCE}
    }
    workgroupBarrier();
    // the KG lanes' sums in a fixed binary tree: lanes [h, 2h) hand theirs to lanes [0, h)
    let o_tile = (l % TILES) * 4u;
    for (var h = KG / 2u; h > 0u; h /= 2u) {
        if (kg >= h && kg < 2u * h) {
            let o = (kg - h) * TILES * 4u + o_tile;
            S[o] = acc0;
            S[o + 1u] = acc1;
            S[o + 2u] = acc2;
            S[o + 3u] = acc3;
        }
        workgroupBarrier();
        if (kg < h) {
            let o = kg * TILES * 4u + o_tile;
            acc0 += S[o];
            acc1 += S[o + 1u];
            acc2 += S[o + 2u];
            acc3 += S[o + 3u];
        }
        workgroupBarrier();
    }
    if (kg == 0u) {
        let alpha1 = prm.alpha1;
        put_t(m0, mq, jq, alpha1 * acc0);
        put_t(m0, mq + MT, jq, alpha1 * acc1);
        put_t(m0, mq + 2u * MT, jq, alpha1 * acc2);
        put_t(m0, mq + 3u * MT, jq, alpha1 * acc3);
    }
    workgroupBarrier();
    // phase 2: the expansion over N in column blocks, DEPTH_EXPAND blocks of loads in flight
    let cn = l % NB;
    let g = l / NB;
    let alpha2 = prm.alpha2;
    let n_blocks = (prm.N + NB - 1u) / NB;
    ${DECLARE_EXPAND}
    ${PROLOGUE_EXPAND}
    for (var b = 0u; b < n_blocks; b += DEPTH_EXPAND) {
        ${BODY_EXPAND}
    }
}
