// LoRA's products that reduce along the contiguous axis of their large operand (t = x A^T, dt = dY B): A(m, k) =
// A[a_off + m lda + k] (row m of x or dY), S(k, n) = B[b_off + k ldb + n] (B: dt = dY B) or, S_KFAST,
// B[b_off + n ldb + k] (A's rows: t = x A^T). Each invocation owns one row m x one block of 16 n (16 sums); a
// workgroup's ROWS rows stage BK steps of A through workgroup memory (vec4 loads that coalesce, the next step's in
// flight during this step's products) and the step's [BK, 16] of S, which every invocation reads at the same
// address. Grid: (column blocks of 16, blocks of ROWS rows, splits of the reduction in whole BK steps).

const ROWS: u32 = ${ROWS}u;
const BK: u32 = ${BK}u;
const KQ: u32 = BK / 4u;       // vec4s of a staged row
const XS: u32 = KQ + 1u;       // padded row stride of Xs (vec4s): rows of 8 lanes fall in distinct banks
const S_KFAST: bool = ${S_KFAST};
var<workgroup> Xs: array<vec4<f32>, ROWS * XS>;   // Xs[row * XS + q] = A(m0 + row, k0 + 4 q .. + 3)
var<workgroup> Ss: array<vec4<f32>, BK * 4u>;     // Ss[k * 4 + q] = S(k0 + k, n0 + 4 q .. + 3)

fn load_x(u: u32, m0: u32, k0: u32, k_end: u32) -> vec4<f32> {
    let m = m0 + u / KQ;
    let k = k0 + 4u * (u % KQ);
    if (m < prm.M && k < k_end) {
        return A[(prm.a_off + m * prm.lda + k) / 4u];
    }
    return vec4<f32>(0.0);
}

fn stage_x(u: u32, v: vec4<f32>) {
    Xs[(u / KQ) * XS + u % KQ] = v;
}

// this invocation's vec4 of the step's S: row-major, S(k0 + lid / 4, n0 + 4 (lid % 4) ..); k-fast, S(k0 + 4 (lid %
// KQ) .., n0 + lid / KQ)
fn load_s(l: u32, s: u32, n0: u32, k0: u32, k_end: u32) -> vec4<f32> {
    if (S_KFAST) {
        let n = l / KQ;
        let k = k0 + 4u * (l % KQ);
        if (l < 16u * KQ && n0 + n < prm.N && k < k_end) {
            return B[(s + n * prm.ldb + k) / 4u];
        }
    } else {
        let k = k0 + l / 4u;
        let q = l % 4u;
        if (l < 4u * BK && n0 + 4u * q < prm.N && k < k_end) {
            return B[(s + k * prm.ldb + 4u * q) / 4u];
        }
    }
    return vec4<f32>(0.0);
}

fn stage_s(l: u32, v: vec4<f32>) {
    if (S_KFAST) {
        if (l < 16u * KQ) {
            let n = l / KQ;
            let k = 4u * (l % KQ);
            Ss[k * 4u + n / 4u][n % 4u] = v.x;
            Ss[(k + 1u) * 4u + n / 4u][n % 4u] = v.y;
            Ss[(k + 2u) * 4u + n / 4u][n % 4u] = v.z;
            Ss[(k + 3u) * 4u + n / 4u][n % 4u] = v.w;
        }
    } else if (l < 4u * BK) {
        Ss[l] = v;
    }
}

@compute @workgroup_size(ROWS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n0 = wid.x * 16u;
    let m0 = wid.y * ROWS;
    let z = wid.z;
    let k_begin = z * prm.chunk;
    let k_end = min(prm.K, k_begin + prm.chunk);
    let base = s_base(n0);
    var s: u32;
    if (S_KFAST) {
        s = base.x + base.y * prm.ldb;
    } else {
        s = base.x + base.y;
    }
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    ${DECLARE}
    var rs = vec4<f32>(0.0);
    if (k_begin < k_end) {
        let kl = k_begin;
        ${LOAD}
        rs = load_s(lid, s, n0, kl, k_end);
    }
    for (var k0 = k_begin; k0 < k_end; k0 += BK) {
        ${STAGE}
        stage_s(lid, rs);
        workgroupBarrier();
        if (k0 + BK < k_end) {
            let kl = k0 + BK;   // the next step's loads, in flight during this step's products
            ${LOAD}
            rs = load_s(lid, s, n0, kl, k_end);
        }
        for (var q = 0u; q < KQ; q++) {
            let x = Xs[lid * XS + q];
            ${FMA}
        }
        workgroupBarrier();
    }
    let m = m0 + lid;
    put_out4(m, n0, z, acc0);
    put_out4(m, n0 + 4u, z, acc1);
    put_out4(m, n0 + 8u, z, acc2);
    put_out4(m, n0 + 12u, z, acc3);
}
