// LoRA's products across the rows of int8 codes (dB = dY^T t, dA^T = x^T dt over the integer path's codes; include
// after lora_paths_common.wgsl and lora_codes_common.wgsl): A(m, k) = code m of row k (row k starts at word a_off +
// k lda, four codes a word), S(k, n) = B[b_off + k ldb + n] (t or dt, row k). Each invocation owns one word of
// the rows (4 consecutive m) x one block of 16 n: 64 sums in registers. Per step of BK rows the workgroup stages
// S's [BK, 16] times KS in workgroup memory, which every invocation then reads at the same address; each
// invocation reads its word of every row of the step from storage (neighbouring invocations, neighbouring words)
// and each code meets the 16 values of its S row in 16 multiply-adds. Grid: (column blocks of 16, blocks of 4
// THREADS m, splits of the rows in whole BK steps).

const THREADS: u32 = ${THREADS}u;
const BK: u32 = ${BK}u;            // rows a step
var<workgroup> Ss: array<vec4<f32>, BK * 4u>;   // Ss[k * 4 + q] = KS(k0 + k) S(k0 + k, n0 + 4 q .. + 3)

fn load_w(w: u32, k: u32, k_end: u32) -> u32 {
    if (4u * w < prm.M && k < k_end) {
        return A[prm.a_off + k * prm.lda + w];
    }
    return 0u;
}

// element l (< 16 BK) of the step's S, times KS: S(k0 + l / 16, n0 + l % 16)
fn stage_s(l: u32, s: u32, n0: u32, k0: u32, k_end: u32) {
    let k = l / 16u;
    let j = l % 16u;
    var v = 0.0;
    if (n0 + j < prm.N && k0 + k < k_end) {
        let i = s + (k0 + k) * prm.ldb + j;
        v = B[i / 4u][i % 4u] * k_factor(k0 + k);
    }
    Ss[k * 4u + j / 4u][j % 4u] = v;
}

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n0 = wid.x * 16u;
    let w = wid.y * THREADS + lid;   // this invocation's word of each row: m = 4 w .. 4 w + 3
    let z = wid.z;
    let k_begin = z * prm.chunk;
    let k_end = min(prm.K, k_begin + prm.chunk);
    let base = s_base(n0);
    let s = base.x + base.y;
    ${DECLARE}
    for (var k0 = k_begin; k0 < k_end; k0 += BK) {
        ${LOAD}
        for (var e = 0u; e < 16u * BK / THREADS; e++) {
            stage_s(lid + e * THREADS, s, n0, k0, k_end);
        }
        workgroupBarrier();
        ${FMA}
        workgroupBarrier();
    }
    ${STORE}
}
