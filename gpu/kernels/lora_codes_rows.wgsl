// LoRA's products along the rows of int8 codes (t = x^ A^T, dt = dY^ B over the integer path's codes; include
// after lora_paths_common.wgsl and lora_codes_common.wgsl): A(m, k) = code k of row m (row m starts at vec4 a_off
// + m lda, 16 codes a vec4), S(k, n) = B[b_off + k ldb + n] or, S_KFAST, B[b_off + n ldb + k] (A's rows: t = x A^T).
// Each invocation owns RPT rows (lid + THREADS j) x one block of 16 n: 16 RPT sums in registers. Per step of BK
// codes the workgroup stages S's [BK, 16] times KS in workgroup memory, which every invocation then reads at the
// same address, and each invocation reads its rows' codes straight from storage, 16 to a load (the other
// workgroups resident on the multiprocessor hide the latency); each code meets the 16 values of its S row in 16
// multiply-adds. Grid: (column blocks of 16, blocks of ROWS rows, splits of the reduction in whole BK steps).

const THREADS: u32 = ${THREADS}u;
const RPT: u32 = ${RPT}u;
const ROWS: u32 = THREADS * RPT;
const BK: u32 = ${BK}u;            // codes of a row a step
const UNITS: u32 = BK / 16u;       // vec4s of codes of a row a step
const S_KFAST: bool = ${S_KFAST};
var<workgroup> Ss: array<vec4<f32>, BK * 4u>;   // Ss[k * 4 + q] = KS(k0 + k) S(k0 + k, n0 + 4 q .. + 3)

fn load_x(m: u32, k: u32, k_end: u32) -> vec4<u32> {
    if (m < prm.M && k < k_end) {
        return A[prm.a_off + m * prm.lda + k / 16u];
    }
    return vec4<u32>(0u);
}

// element l (< 16 BK) of the step's S, times KS: row-major S(k0 + l / 16, n0 + l % 16), k-fast S(k0 + l % BK,
// n0 + l / BK) (neighbouring invocations read neighbouring elements)
fn stage_s(l: u32, s: u32, n0: u32, k0: u32, k_end: u32) {
    var k: u32;
    var j: u32;
    if (S_KFAST) {
        k = l % BK;
        j = l / BK;
    } else {
        k = l / 16u;
        j = l % 16u;
    }
    var v = 0.0;
    if (n0 + j < prm.N && k0 + k < k_end) {
        var i: u32;
        if (S_KFAST) {
            i = s + j * prm.ldb + k0 + k;
        } else {
            i = s + (k0 + k) * prm.ldb + j;
        }
        v = B[i / 4u][i % 4u] * k_factor(k0 + k);
    }
    Ss[k * 4u + j / 4u][j % 4u] = v;
}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n0 = wid.x * 16u;
    let m0 = wid.y * ROWS + lid;
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
    ${DECLARE}
    for (var k0 = k_begin; k0 < k_end; k0 += BK) {
        for (var e = 0u; e < 16u; e++) {
            stage_s(lid + e * THREADS, s, n0, k0, k_end);
        }
        workgroupBarrier();
        for (var u = 0u; u < UNITS; u++) {
            ${LOAD}
            ${FMA}
        }
        workgroupBarrier();
    }
    ${STORE}
}
