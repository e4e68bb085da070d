// int8 codes of one row held in registers (include after int8_pack.wgsl and hadamard.wgsl).
// One row (or chunk; its first column col0) of `units` groups of four values to codes at Q[q0 ..], returning its
// scale: the values stay in registers between the absmax and the packing (PER groups per invocation; a longer row
// reads the rest twice, and cannot be rotated: the host keeps rotated rows within PER * WG groups), each group
// rotated as it is loaded when ROT > 0.
// The kernel defines WG, Q (array<u32>) and fn group4(w: u32) -> vec4<f32> (values 4w .. 4w + 3 of the row).
// Call from uniform control flow (workgroup_reduce, rotate_group).
const PER: u32 = 16u;

// group w of the row (zeros past its end)
fn loaded_group(w: u32, units: u32) -> vec4<f32> {
    if (w < units) {
        return group4(w);
    }
    return vec4<f32>();
}

fn codes_of_row(lid: u32, units: u32, q0: u32, col0: u32) -> f32 {
    var v: array<vec4<f32>, PER>;
    if (ROT == 0u || rotation_shuffled(lid, ROT / 4u)) {   // no barrier in the loop: unrolled, v in registers
        for (var j = 0u; j < PER; j++) {
            var x = loaded_group(lid + j * WG, units);
            if (ROT > 0u && j * WG < units) {   // uniform: a block's groups are all in (units % (ROT / 4) == 0)
                x = rotate_group_shuffled(lid, x, col0 + 4u * (lid + j * WG), false);
            }
            v[j] = x;
        }
    } else {   // subgroups narrower than a block: exchanges through workgroup memory
        for (var j = 0u; j < PER; j++) {
            var x = loaded_group(lid + j * WG, units);
            if (j * WG < units) {
                x = rotate_group_shared(lid, x, col0 + 4u * (lid + j * WG), false);
            }
            v[j] = x;
        }
    }
    var m = 0.0;
    for (var j = 0u; j < PER; j++) {
        m = max(m, absmax4(v[j]));
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
