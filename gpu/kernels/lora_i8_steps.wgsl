// The staged steps of LoRA's integer thin products (include of lora_thin_i8 and lora_sum_i8, which define Params,
// the operands, the constants, the workgroup arrays, tile_start(wid) / reduction_start(wid) / reduction_length(),
// ld_left / ld_right (a vec4 unit of the left operand's tile or of the right rows, at a reduction offset),
// put_left / put_right (a unit into workgroup memory) and p_base(wid, sg) (the subgroup's first sum in P)): per
// step BK values of the reduction are staged, the next step's loaded into registers meanwhile, then multiplied
// (the variant's compute); the i32 sums leave for P (its store).

// this invocation's units of the left operand's tile from t0 and of the right rows, at reduction offset k0
fn fetch(rl: ptr<function, array<vec4<u32>, LU>>, rr: ptr<function, array<vec4<u32>, RU>>, lid: u32, t0: u32,
         k0: u32) {
    for (var e = 0u; e < LU; e++) {
        (*rl)[e] = ld_left(lid + e * THREADS, t0, k0);
    }
    for (var e = 0u; e < RU; e++) {
        let u = lid + e * THREADS;
        if (u < BN * UPR) {
            (*rr)[e] = ld_right(u, k0);
        }
    }
}

// a unit's four words as a staged block holds them
fn words(v: vec4<u32>) -> vec4<i32> {
    return bitcast<vec4<i32>>(v);
}
${HELPERS}

@compute @workgroup_size(THREADS)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,${SG_PARAM}
) {${SG_LET}
    let t0 = tile_start(wid);
    let k0 = reduction_start(wid);
    let steps = min(prm.chunk, reduction_length() - k0) / BK;
${ACC_DECL}
    var rl: array<vec4<u32>, LU>;   // this invocation's units of the next step, loaded ahead
    var rr: array<vec4<u32>, RU>;
    fetch(&rl, &rr, lid, t0, k0);
    for (var t = 0u; t < steps; t++) {
        workgroupBarrier();
        for (var e = 0u; e < LU; e++) {
            put_left(lid + e * THREADS, rl[e]);
        }
        for (var e = 0u; e < RU; e++) {
            let u = lid + e * THREADS;
            if (u < BN * UPR) {
                put_right(u, rr[e]);
            }
        }
        workgroupBarrier();
        if (t + 1u < steps) {
            fetch(&rl, &rr, lid, t0, k0 + (t + 1u) * BK);
        }
${COMPUTE}
    }
    let base = p_base(wid, sg);
${STORE}
}
