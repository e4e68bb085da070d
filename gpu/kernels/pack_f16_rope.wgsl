// pack_f16.wgsl for attention's q or k with RoPE applied on the way (rope.wgsl's rotation, sign +1, positions from
// a buffer): dst (f16 [b, P, NH, D], P = padded rows, padding zero) = RoPE(src [b T, NH, D]) with the same f32
// products and rounding as rope_forward then pack_f16, so the f32 RoPE'd copy is neither written nor read back.
// One thread per pair of a padded sequence (grid z: the sequence); pairs as rope.wgsl (NEOX: halves, else adjacent).
enable f16;

struct Params {
    T: u32,       // rows of a sequence
    P: u32,       // padded rows of a sequence in dst
    NH: u32,      // heads
    D: u32,       // head dim (even)
    n_pos: u32,   // table rows
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> CS: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read> X: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f16>;
@group(0) @binding(4) var<storage, read> positions: array<u32>;

const NEOX: bool = ${NEOX};

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;   // pair within the padded sequence wid.z
    let half = prm.D / 2u;
    let per_row = prm.NH * half;
    if (i >= prm.P * per_row) {
        return;
    }
    let t = i / per_row;
    let j = i % half;
    let e0 = (i / half) * prm.D + select(2u * j, j, NEOX);   // element within the sequence
    let e1 = e0 + select(1u, half, NEOX);
    let out0 = wid.z * prm.P * prm.NH * prm.D;
    if (t >= prm.T) {
        Y[out0 + e0] = f16(0.0);
        Y[out0 + e1] = f16(0.0);
        return;
    }
    let in0 = wid.z * prm.T * prm.NH * prm.D;
    let pos = min(positions[wid.z * prm.T + t], prm.n_pos - 1u);
    let cs = CS[pos * half + j];
    let s = cs.y;
    let x0 = X[in0 + e0];
    let x1 = X[in0 + e1];
    Y[out0 + e0] = f16(x0 * cs.x - x1 * s);
    Y[out0 + e1] = f16(x0 * s + x1 * cs.x);
}
