// Y[r, :] (+)= X[r, :] R^T for the rows of X: R the rotation of hadamard.wgsl (blocks of ROT). The integer GEMM's
// input gradient over rotated weight codes gives dX R (R R^T = I): this turns it back. Mode "forward" writes
// Y = X R instead (a LoRA A rotated like the codes, for the term that GEMM adds in its epilogue).
// A workgroup per row (rows_rotated.wgsl), PER groups of four per invocation (rows up to 4 PER WG values), each rotated as
// it is loaded. In place (mode "back"): Y is X, one binding (each invocation stores the groups it loaded); else Y
// another binding, added to ("back_add") or written ("forward").

struct Params {
    T: u32,   // rows
    k: u32,   // row length, a multiple of ROT
    _pad0: u32,
    _pad1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
${BINDINGS}

const WG: u32 = 256u;
const PER: u32 = 16u;

fn row_main(r: u32, lid: u32) {
    let units = prm.k / 4u;
    let base = r * units;
    let shuffled = rotation_shuffled(lid, ROT / 4u);
    for (var j = 0u; j < PER; j++) {   // each invocation stores only the groups it loaded: in place is safe
        let w = lid + j * WG;
        if (j * WG < units) {   // uniform
            var x = vec4<f32>();
            if (w < units) {
                x = X[base + w];
            }
            var y: vec4<f32>;
            if (shuffled) {
                y = rotate_group_shuffled(lid, x, 4u * w, ${BACK});
            } else {
                y = rotate_group_shared(lid, x, 4u * w, ${BACK});
            }
            if (w < units) {
                ${STORE}
            }
        }
    }
}
