// int8 codes (include of quantize_i8.wgsl and weight_i8.wgsl; model/int8.py is the twin): the absmax tree's
// combine for workgroup_reduce.wgsl, and the codes of values for a scale: round(x / scale), ties to even,
// clamped to +-127, one byte each (0 for scale 0: an all-zero row or chunk), four packed little-endian per word.
alias Reduced = f32;

fn combine(a: Reduced, b: Reduced) -> Reduced {
    return max(a, b);
}

fn code(x: f32, scale: f32) -> u32 {
    let q = select(0.0, clamp(round(x / scale), -127.0, 127.0), scale > 0.0);
    return u32(i32(q)) & 0xffu;
}

fn pack4(v: vec4<f32>, scale: f32) -> u32 {
    return code(v.x, scale) | (code(v.y, scale) << 8u) | (code(v.z, scale) << 16u) | (code(v.w, scale) << 24u);
}

// One row (or chunk) of `units` groups of four values to codes at Q[q0 ..], returning its scale: the values stay
// in registers between the absmax and the packing (PER groups per invocation; a longer row reads the rest twice).
// The kernel defines WG, Q (array<u32>) and fn group4(w: u32) -> vec4<f32> (values 4w .. 4w + 3 of the row).
// Call from uniform control flow (workgroup_reduce).
const PER: u32 = 16u;

fn absmax4(v: vec4<f32>) -> f32 {
    let a = abs(v);
    return max(max(a.x, a.y), max(a.z, a.w));
}

fn codes_of_row(lid: u32, units: u32, q0: u32) -> f32 {
    var v: array<vec4<f32>, PER>;
    var m = 0.0;
    for (var j = 0u; j < PER; j++) {
        let w = lid + j * WG;
        if (w < units) {
            v[j] = group4(w);
            m = max(m, absmax4(v[j]));
        }
    }
    for (var w = lid + PER * WG; w < units; w += WG) {
        m = max(m, absmax4(group4(w)));
    }
    let scale = workgroup_reduce(lid, m) / 127.0;
    for (var j = 0u; j < PER; j++) {
        let w = lid + j * WG;
        if (w < units) {
            Q[q0 + w] = pack4(v[j], scale);
        }
    }
    for (var w = lid + PER * WG; w < units; w += WG) {
        Q[q0 + w] = pack4(group4(w), scale);
    }
    return scale;
}
