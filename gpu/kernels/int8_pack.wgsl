// int8 codes (include of quantize_i8, weight_i8, weight_i8_q4_k, rmsnorm_i8 and rmsnorm_i8_units; model/int8.py is the twin): the codes
// of values for a scale: round(x / scale), ties to even, clamped to +-127, one byte each (0 for scale 0: an
// all-zero row or chunk), four packed little-endian per word.

fn code(x: f32, scale: f32) -> u32 {
    let q = select(0.0, clamp(round(x / scale), -127.0, 127.0), scale > 0.0);
    return u32(i32(q)) & 0xffu;
}

fn pack4(v: vec4<f32>, scale: f32) -> u32 {
    return code(v.x, scale) | (code(v.y, scale) << 8u) | (code(v.z, scale) << 16u) | (code(v.w, scale) << 24u);
}

fn absmax4(v: vec4<f32>) -> f32 {
    let a = abs(v);
    return max(max(a.x, a.y), max(a.z, a.w));
}

// a unit of 16 values (hadamard.wgsl rotate_unit's): its absmax, and its codes as four words
fn absmax16(v: array<vec4<f32>, 4>) -> f32 {
    return max(max(absmax4(v[0]), absmax4(v[1])), max(absmax4(v[2]), absmax4(v[3])));
}

fn pack16(v: array<vec4<f32>, 4>, scale: f32) -> vec4<u32> {
    return vec4<u32>(pack4(v[0], scale), pack4(v[1], scale), pack4(v[2], scale), pack4(v[3], scale));
}
