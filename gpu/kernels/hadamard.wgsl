// Block-diagonal Walsh-Hadamard rotation with pseudo-random signs of a row held in registers (include;
// model/int8.py hadamard_rows is the numpy twin): x R, R = S H_b, S = diag(+-1) (rotation_signs: bit 13 of
// col * 0x9E3779B1), H_b block-diagonal with blocks H / sqrt(ROT) (ROT a power of two, 4 .. 4 WG; 0: none), H the
// Sylvester Hadamard matrix (H[i, j] = (-1)^popcount(i & j), symmetric); back: x R^T = (x H_b) S, which undoes it.
// The integer GEMM rotates both operands along the reduction axis, (x R)(W R)^T = x W^T, so an outlier input
// spreads over its block and one row scale fits the rest better (QuaRot); the signs keep a block's mean out of
// one coefficient. The butterflies in index order h = 1, 2, 4, ...: h = 1, 2 within an invocation's vec4, the
// rest through workgroup memory between invocations lid and lid ^ (h / 4). The kernel defines WG and PER and
// holds values 4 (lid + j WG) .. + 3 (columns col0 + those) in v[j]; every invocation calls rotate_row from
// uniform control flow (barriers).
const ROT: u32 = ${ROT}u;

var<workgroup> rot_xchg: array<vec4<f32>, WG>;

fn butterfly4(v: vec4<f32>) -> vec4<f32> {
    let a = vec4<f32>(v.x + v.y, v.x - v.y, v.z + v.w, v.z - v.w);
    return vec4<f32>(a.x + a.z, a.y + a.w, a.x - a.z, a.y - a.w);
}

// the signs of columns c .. c + 3
fn rotation_signs(c: u32) -> vec4<f32> {
    let bits = ((vec4<u32>(c, c + 1u, c + 2u, c + 3u) * 0x9E3779B1u) >> vec4<u32>(13u)) & vec4<u32>(1u);
    return vec4<f32>(1.0) - 2.0 * vec4<f32>(bits);
}

// rotate the first ceil(units / WG) of v's groups (units: the row's groups of four, a multiple of ROT / 4)
fn rotate_row(lid: u32, v: ptr<function, array<vec4<f32>, PER>>, units: u32, col0: u32, back: bool) {
    if (ROT == 0u) {
        return;
    }
    let norm = inverseSqrt(f32(max(ROT, 1u)));   // (ROT 0 never gets here, but the constant is folded)
    for (var j = 0u; j < PER && j * WG < units; j++) {
        let signs = rotation_signs(col0 + 4u * (lid + j * WG));
        var x = butterfly4(select((*v)[j] * signs, (*v)[j], back));
        for (var d = 1u; d < ROT / 4u; d <<= 1u) {
            rot_xchg[lid] = x;
            workgroupBarrier();
            let p = rot_xchg[lid ^ d];
            workgroupBarrier();
            x = select(x + p, p - x, (lid & d) != 0u);
        }
        (*v)[j] = select(x * norm, x * norm * signs, back);
    }
}
