// int8 codes of one row held in registers (include after int8_pack.wgsl and hadamard.wgsl).
// One row (or chunk; its first column col0) of `units` groups of four values to codes at Q[q0 ..], returning its
// scale: the values stay in registers between the absmax and the packing (PER groups per invocation; a longer row
// reads the rest twice); a rotated row (ROT > 0; at most PER * WG groups, the host's check) is read and rotated
// twice instead.
// The kernel defines WG, Q (array<u32>), fn group4(w: u32) -> vec4<f32> (values 4w .. 4w + 3 of the row), and
// fn row_scale(lid: u32, m: f32) -> f32, the row's scale from each invocation's part m of its absmax (usually
// workgroup_reduce(lid, m) / 127), with const ABSMAX: false when row_scale ignores m (a frozen weight's scale kept
// from an earlier decode: the same codes), and no absmax is taken.
// Call from uniform control flow (workgroup_reduce, rotate_group).
const PER: u32 = 16u;

fn codes_of_row(lid: u32, units: u32, q0: u32, col0: u32) -> f32 {
    if (ROT > 0u) {
        return rotated_codes_of_row(lid, units, q0, col0);
    }
    return plain_codes_of_row(lid, units, q0);
}

// codes_of_row of a row that is not rotated (whatever ROT: a kernel whose rotation is of another operand calls it)
fn plain_codes_of_row(lid: u32, units: u32, q0: u32) -> f32 {
    var v: array<vec4<f32>, PER>;
    var m = 0.0;
    for (var j = 0u; j < PER; j++) {
        let w = lid + j * WG;
        if (w < units) {
            v[j] = group4(w);
            m = max(m, absmax4(v[j]));
        }
    }
    for (var w = lid + PER * WG; w < units && ABSMAX; w += WG) {
        m = max(m, absmax4(group4(w)));
    }
    let scale = row_scale(lid, m);
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

// group w rotated (w's block: every invocation of the workgroup passes a group of the same lid + j WG)
fn rotated_group(lid: u32, w: u32, units: u32, col0: u32, shuffled: bool) -> vec4<f32> {
    var x = vec4<f32>();
    if (w < units) {
        x = group4(w);
    }
    if (shuffled) {
        return rotate_group_shuffled(lid, x, col0 + 4u * w, false);
    }
    return rotate_group_shared(lid, x, col0 + 4u * w, false);
}

// codes_of_row of a rotated row (at most PER * WG groups): the groups loaded and rotated twice, for the absmax and
// for the codes (the second read from cache), so that no array indexed by a loop with barriers leaves the registers
fn rotated_codes_of_row(lid: u32, units: u32, q0: u32, col0: u32) -> f32 {
    let shuffled = rotation_shuffled(lid, ROT / 4u);
    var m = 0.0;
    for (var j = 0u; j < PER && ABSMAX; j++) {
        if (j * WG < units) {   // uniform: a block's groups are all in (units % (ROT / 4) == 0)
            m = max(m, absmax4(rotated_group(lid, lid + j * WG, units, col0, shuffled)));
        }
    }
    let scale = row_scale(lid, m);
    for (var j = 0u; j < PER; j++) {
        if (j * WG < units) {
            let w = lid + j * WG;
            let x = rotated_group(lid, w, units, col0, shuffled);
            if (w < units) {
                Q[q0 + w] = pack4(x, scale);
            }
        }
    }
    return scale;
}
