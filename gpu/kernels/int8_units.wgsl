// Units of 16 consecutive values of a row held in registers, four an invocation (include after int8_pack.wgsl and
// hadamard.wgsl; weight_i8_q4_k.wgsl's layout): unit u = lid + j WG of the row in v_j, j < 4 (rows of at most
// 64 WG values). Call from uniform control flow.

// rotate each present unit (hadamard.wgsl rotate_unit: the butterflies of h < 16 within an invocation, the rest
// by subgroup shuffles; ROT >= 16); col0: the row's first column (the rotation's signs). Units past the row are
// zeros in blocks of their own.
fn rotate_units(lid: u32, units: u32, col0: u32, v0: ptr<function, array<vec4<f32>, 4>>,
                v1: ptr<function, array<vec4<f32>, 4>>, v2: ptr<function, array<vec4<f32>, 4>>,
                v3: ptr<function, array<vec4<f32>, 4>>) {
    let shuffled = rotation_shuffled(lid, ROT / 16u);
    rotate_unit(lid, v0, col0 + 16u * lid, shuffled);
    if (WG < units) {
        rotate_unit(lid, v1, col0 + 16u * (lid + WG), shuffled);
    }
    if (2u * WG < units) {
        rotate_unit(lid, v2, col0 + 16u * (lid + 2u * WG), shuffled);
    }
    if (3u * WG < units) {
        rotate_unit(lid, v3, col0 + 16u * (lid + 3u * WG), shuffled);
    }
}

// each present unit's codes for the scale, to Q[q0 + u] (Q: array<vec4<u32>>, the kernel's)
fn store_unit_codes(lid: u32, units: u32, q0: u32, scale: f32, v0: array<vec4<f32>, 4>, v1: array<vec4<f32>, 4>,
                    v2: array<vec4<f32>, 4>, v3: array<vec4<f32>, 4>) {
    if (lid < units) {
        Q[q0 + lid] = pack16(v0, scale);
    }
    if (lid + WG < units) {
        Q[q0 + lid + WG] = pack16(v1, scale);
    }
    if (lid + 2u * WG < units) {
        Q[q0 + lid + 2u * WG] = pack16(v2, scale);
    }
    if (lid + 3u * WG < units) {
        Q[q0 + lid + 3u * WG] = pack16(v3, scale);
    }
}
