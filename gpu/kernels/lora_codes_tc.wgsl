// LoRA's products over int8 codes on the f16 tensor cores (include after lora_paths_common.wgsl and
// lora_codes_common.wgsl; gpu/ops/lora_matmul.py Codes, Dawn's subgroup matrices): the products of
// lora_codes_rows.wgsl (ACROSS false: A(m, k) = code k of row m, t = x^ A^T and dt = dY^ B) and
// lora_codes_across.wgsl (ACROSS true: A(m, k) = code m of row k, dB = dY^T t and dA^T = x^T dt) as 16 x 16 x 16
// multiply-accumulates. A workgroup of SG subgroups owns BM = 16 SG output rows x one block of 16 n over split z's
// chunk; per step it stages BK of A's reduction as f16 (codes are exact in f16) and S's [BK, 16] times KS as f16,
// and each subgroup multiplies its 16 rows. S is first scaled by the power of two that puts the chunk's largest
// |KS S| in [2^10, 2^11) (f16 keeps 11 bits and reaches 2^-24: the chunk's values down to 2^-24 of its largest),
// and the sums are scaled back in f32: S rounded to f16 is the only rounding besides f32 accumulation.
// A's rows start at vec4 a_off + row lda (16 codes a vec4). Grid: (column blocks of 16, blocks of BM rows, splits).

const SG: u32 = 4u;
const THREADS: u32 = SG * 32u;
const BM: u32 = SG * 16u;
const BK: u32 = ${BK}u;
const ACROSS: bool = ${ACROSS};
const S_KFAST: bool = ${S_KFAST};
const LDA: u32 = ${LDA}u;          // staged row stride of As (f16): rows m x BK codes, or (ACROSS) rows k x BM codes
const LDB: u32 = 24u;              // staged row stride of Bs (f16): rows k x 16 n
const A_UNITS: u32 = ${A_UNITS}u;  // vec4s of codes staged per step
const UPR: u32 = ${UPR}u;          // vec4s of codes a staged row
var<workgroup> As: array<f16, ${A_LEN}>;
var<workgroup> Bs: array<f16, BK * LDB>;
var<workgroup> Cs: array<f32, SG * 256u>;
var<workgroup> Red: array<f32, SG>;

// KS(k) S(k, n0 + j), 0 outside
fn s_value(s: u32, k: u32, j: u32, n0: u32, k_end: u32) -> f32 {
    if (n0 + j >= prm.N || k >= k_end) {
        return 0.0;
    }
    var i: u32;
    if (S_KFAST) {
        i = s + j * prm.ldb + k;
    } else {
        i = s + k * prm.ldb + j;
    }
    return B[i / 4u][i % 4u] * k_factor(k);
}

// staging unit u of the step at k0: 16 codes of staged row u / UPR as f16
fn stage_a(u: u32, m0: u32, k0: u32, k_end: u32) {
    let r = u / UPR;
    let q = u % UPR;
    var w = vec4<u32>(0u);
    if (ACROSS) {
        if (k0 + r < k_end && m0 + 16u * q < prm.M) {
            w = A[prm.a_off + (k0 + r) * prm.lda + m0 / 16u + q];
        }
    } else if (m0 + r < prm.M && k0 + 16u * q < k_end) {
        w = A[prm.a_off + (m0 + r) * prm.lda + k0 / 16u + q];
    }
    let o = r * LDA + 16u * q;
    for (var e = 0u; e < 4u; e++) {
        let c = codes4(w[e]);
        As[o + 4u * e] = f16(c.x);
        As[o + 4u * e + 1u] = f16(c.y);
        As[o + 4u * e + 2u] = f16(c.z);
        As[o + 4u * e + 3u] = f16(c.w);
    }
}

@compute @workgroup_size(THREADS)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let n0 = wid.x * 16u;
    let m0 = wid.y * BM;
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
    // the chunk's largest |KS S| and the power of two that scales it into [2^10, 2^11)
    var big = 0.0;
    for (var i = lid; i < (k_end - k_begin) * 16u; i += THREADS) {
        big = max(big, abs(s_value(s, k_begin + i / 16u, i % 16u, n0, k_end)));
    }
    big = subgroupMax(big);
    if (lane == 0u) {
        Red[sg] = big;
    }
    workgroupBarrier();
    big = max(max(Red[0], Red[1]), max(Red[2], Red[3]));
    var f = 1.0;
    if (big > 0.0) {
        f = exp2(10.0 - floor(log2(big)));
    }
    var acc = subgroup_matrix_result<f32, 16, 16>();
    for (var k0 = k_begin; k0 < k_end; k0 += BK) {
        for (var u = lid; u < A_UNITS; u += THREADS) {
            stage_a(u, m0, k0, k_end);
        }
        for (var l = lid; l < 16u * BK; l += THREADS) {
            var k: u32;
            var j: u32;
            if (S_KFAST) {
                k = l % BK;
                j = l / BK;
            } else {
                k = l / 16u;
                j = l % 16u;
            }
            Bs[k * LDB + j] = f16(s_value(s, k0 + k, j, n0, k_end) * f);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK / 16u; kk++) {
            var left: subgroup_matrix_left<f16, 16, 16>;
            if (ACROSS) {
                left = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&As, kk * 16u * LDA + sg * 16u, true, LDA);
            } else {
                left = subgroupMatrixLoad<subgroup_matrix_left<f16, 16, 16>>(&As, sg * 16u * LDA + kk * 16u, false, LDA);
            }
            let right = subgroupMatrixLoad<subgroup_matrix_right<f16, 16, 16>>(&Bs, kk * 16u * LDB, false, LDB);
            acc = subgroupMatrixMultiplyAccumulate(left, right, acc);
        }
        workgroupBarrier();
    }
    subgroupMatrixStore(&Cs, sg * 256u, acc, false, 16u);
    workgroupBarrier();
    let inv = 1.0 / f;
    for (var e = 0u; e < 8u; e++) {
        let i = lane * 8u + e;
        let m = m0 + sg * 16u + i / 16u;
        put_out(m, n0 + i % 16u, z, Cs[sg * 256u + i] * inv * m_factor(m));
    }
}
