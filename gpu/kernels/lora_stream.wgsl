// LoRA's products that reduce over the rows of their large operand (dB = dY^T t, dA^T = x^T dt): A(m, k) =
// A[a_off + k lda + m] (the large operand's row k, m contiguous), S(k, n) = B[b_off + k ldb + n] (t or dt, row k).
// No staging: each invocation owns 4 consecutive m x one block of 16 n (64 sums in registers) and walks the rows
// of its split, UNROLL rows at a time (their loads all in flight), reading A's vec4 and the row of S every
// invocation of the row group shares. ROW_GROUPS row groups of COLS invocations take interleaved rows; their sums
// are added in fixed order through workgroup memory (deterministic, no atomics). Grid: (column blocks of 16,
// blocks of 4 COLS m, splits).

const COLS: u32 = ${COLS}u;
const ROW_GROUPS: u32 = ${ROW_GROUPS}u;
const UNROLL: u32 = ${UNROLL}u;
var<workgroup> Red: array<vec4<f32>, ${RED_LEN}>;

fn a_row(k: u32, m: u32, k_end: u32) -> vec4<f32> {
    if (k < k_end && m < prm.M) {
        return A[(prm.a_off + k * prm.lda + m) / 4u];
    }
    return vec4<f32>(0.0);
}

fn s_row(k: u32, s: u32, n: u32, k_end: u32) -> vec4<f32> {
    if (k < k_end && n < prm.N) {
        return B[(s + k * prm.ldb) / 4u];
    }
    return vec4<f32>(0.0);
}

@compute @workgroup_size(COLS * ROW_GROUPS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c = lid % COLS;
    let g = lid / COLS;
    let n0 = wid.x * 16u;
    let m = (wid.y * COLS + c) * 4u;
    let z = wid.z;
    let k_begin = z * prm.chunk;
    let k_end = min(prm.K, k_begin + prm.chunk);
    let base = s_base(n0);
    let s0 = base.x + base.y;   // S's element (row 0, column n0)
    ${DECLARE}
    for (var k = k_begin + g; k < k_end; k += ROW_GROUPS * UNROLL) {
        ${LOAD}
        ${FMA}
    }
    ${REDUCE}
    if (g == 0u) {
        ${STORE}
    }
}
