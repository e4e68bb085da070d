// Block-diagonal Walsh-Hadamard rotation with pseudo-random signs of a row held in registers (include;
// model/int8.py hadamard_rows is the numpy twin): x R, R = S H_b, S = diag(+-1) (with_signs: bit 13 of
// col * 0x9E3779B1), H_b block-diagonal with blocks H / sqrt(ROT) (ROT a power of two, 4 .. 4 WG; 0: none), H the
// Sylvester Hadamard matrix (H[i, j] = (-1)^popcount(i & j), symmetric); back: x R^T = (x H_b) S, which undoes it.
// The integer GEMM rotates both operands along the reduction axis, (x R)(W R)^T = x W^T, so an outlier input
// spreads over its block and one row scale fits the rest better (QuaRot); the signs keep a block's mean out of
// one coefficient. The butterflies in index order h = 1, 2, 4, ...: h = 1, 2 within an invocation's vec4, the
// rest between invocations lid and lid ^ (h / 4): subgroup shuffles where a block's ROT / 4 invocations share a
// subgroup (lanes lid % subgroup size, as Vulkan drivers lay out a 1-D workgroup), else workgroup memory. The
// kernel defines WG, sets rot_subgroup to its subgroup size (@builtin(subgroup_size)) and lists
// subgroups_directive.wgsl first; every invocation calls the rotations from uniform control flow (barriers), one
// group (or unit) at a time: no array indexed by a loop that holds barriers (such an array leaves the registers).
const ROT: u32 = ${ROT}u;

var<workgroup> rot_xchg: array<array<vec4<f32>, WG>, 2>;   // ping-pong: one barrier per butterfly stage
var<workgroup> rot_width: u32;
var<private> rot_subgroup: u32;
var<private> rot_buf: u32;   // the ping-pong buffer the next exchange writes

fn butterfly4(v: vec4<f32>) -> vec4<f32> {
    let a = vec4<f32>(v.x + v.y, v.x - v.y, v.z + v.w, v.z - v.w);
    return vec4<f32>(a.x + a.z, a.y + a.w, a.x - a.z, a.y - a.w);
}

// v times the signs of columns c .. c + 3 (bit 13 of col * 0x9E3779B1 set: -1), by flipping the sign bits (the
// same values as the product; fewer instructions than making the signs and multiplying)
fn with_signs(v: vec4<f32>, c: u32) -> vec4<f32> {
    let h = vec4<u32>(c * 0x9E3779B1u) + vec4<u32>(0u, 0x9E3779B1u, 0x3C6EF362u, 0xDAA66D13u);
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(v) ^ ((h << vec4<u32>(18u)) & vec4<u32>(0x80000000u)));
}

// whether the exchanges go through subgroup shuffles: a block's lanes (invocations) within one subgroup (uniform)
fn rotation_shuffled(lid: u32, lanes: u32) -> bool {
    if (lid == 0u) {
        rot_width = rot_subgroup;
    }
    return workgroupUniformLoad(&rot_width) >= lanes;
}

// invocation lid ^ d's x through workgroup memory (every invocation calls it with the same d)
fn exchange_shared(lid: u32, x: vec4<f32>, d: u32) -> vec4<f32> {
    rot_xchg[rot_buf][lid] = x;
    workgroupBarrier();
    let p = rot_xchg[rot_buf][lid ^ d];
    rot_buf ^= 1u;   // the next exchange writes the other buffer: no barrier before it
    return p;
}

// the butterfly of invocation lid with its partner's p at distance d: the lower one a + b, the upper a - b, as
// p + x * (+-1) in one fused multiply-add (the product is exact: the same sum or difference, one rounding)
fn butterfly(lid: u32, x: vec4<f32>, p: vec4<f32>, d: u32) -> vec4<f32> {
    return fma(x, vec4<f32>(select(1.0, -1.0, (lid & d) != 0u)), p);
}

// The rotation (back: its transpose) of an invocation's group of four values, columns col .. col + 3; every
// invocation calls it with a group of the same j (lid + j WG). Two functions, so that a loop over an
// invocation's groups through the shuffled one holds no barrier (and is unrolled, its array in registers).
fn rotate_group_shuffled(lid: u32, v: vec4<f32>, col: u32, back: bool) -> vec4<f32> {
    var x = butterfly4(select(with_signs(v, col), v, back));
    for (var d = 1u; d < ROT / 4u; d <<= 1u) {
        x = butterfly(lid, x, subgroupShuffleXor(x, d), d);
    }
    let norm = inverseSqrt(f32(max(ROT, 1u)));   // (ROT 0 never gets here, but the constant is folded)
    return select(x * norm, with_signs(x * norm, col), back);
}

fn rotate_group_shared(lid: u32, v: vec4<f32>, col: u32, back: bool) -> vec4<f32> {
    var x = butterfly4(select(with_signs(v, col), v, back));
    for (var d = 1u; d < ROT / 4u; d <<= 1u) {
        x = butterfly(lid, x, exchange_shared(lid, x, d), d);
    }
    let norm = inverseSqrt(f32(max(ROT, 1u)));
    return select(x * norm, with_signs(x * norm, col), back);
}

// forward-rotate one invocation's unit of 16 consecutive values (columns col0 ..; units of invocations lid and
// lid ^ d adjacent in the row: ROT >= 16); shuffled = rotation_shuffled(lid, ROT / 16)
fn rotate_unit(lid: u32, v: ptr<function, array<vec4<f32>, 4>>, col0: u32, shuffled: bool) {
    var a0 = butterfly4(with_signs((*v)[0], col0));
    var a1 = butterfly4(with_signs((*v)[1], col0 + 4u));
    var a2 = butterfly4(with_signs((*v)[2], col0 + 8u));
    var a3 = butterfly4(with_signs((*v)[3], col0 + 12u));
    let b0 = a0 + a1;   // h = 4 between the vec4s i and i ^ 1, h = 8 between i and i ^ 2
    let b1 = a0 - a1;
    let b2 = a2 + a3;
    let b3 = a2 - a3;
    a0 = b0 + b2;
    a1 = b1 + b3;
    a2 = b0 - b2;
    a3 = b1 - b3;
    for (var d = 1u; d < ROT / 16u; d <<= 1u) {   // no array: plain values whether or not this loop is unrolled
        if (shuffled) {
            a0 = butterfly(lid, a0, subgroupShuffleXor(a0, d), d);
            a1 = butterfly(lid, a1, subgroupShuffleXor(a1, d), d);
            a2 = butterfly(lid, a2, subgroupShuffleXor(a2, d), d);
            a3 = butterfly(lid, a3, subgroupShuffleXor(a3, d), d);
        } else {
            a0 = butterfly(lid, a0, exchange_shared(lid, a0, d), d);
            a1 = butterfly(lid, a1, exchange_shared(lid, a1, d), d);
            a2 = butterfly(lid, a2, exchange_shared(lid, a2, d), d);
            a3 = butterfly(lid, a3, exchange_shared(lid, a3, d), d);
        }
    }
    let norm = inverseSqrt(f32(max(ROT, 1u)));
    *v = array<vec4<f32>, 4>(a0 * norm, a1 * norm, a2 * norm, a3 * norm);
}
