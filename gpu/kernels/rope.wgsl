// RoPE: (y0, y1) = (x0 c - x1 s', x0 s' + x1 c) with s' = sign * sin, on the pairs of llama.cpp's NORM variant
// (adjacent: x[2i], x[2i+1]; llama) or, with NEOX, its NEOX variant (halves: x[i], x[i + D/2]; qwen2, qwen3).
// sign = +1: forward; sign = -1: backward (the transpose of a rotation is the opposite rotation).
// cos/sin come from a table CS[pos, i] = (cos, sin)(pos * theta_i) computed in float64 on the host (theta_i =
// base^(-2i/D), divided by Llama 3's frequency factors when the model has them), so the angles match the reference
// exactly. One thread per pair. The position of row t is `fn position(t)`
// of the file after this one: rope_position_offset.wgsl (start + t) or rope_position_buffer.wgsl
// (start + positions[t], the positions bound at @binding(4)).

struct Params {
    T: u32,
    NH: u32,        // heads
    D: u32,         // head dim (even)
    start: u32,     // position offset
    sign: f32,
    n_pos: u32,     // table rows
    _pad0: u32,
    _pad1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> CS: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read> X: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;

const NEOX: bool = ${NEOX};

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    let half = prm.D / 2u;
    if (i >= prm.T * prm.NH * half) {
        return;
    }
    let t = i / (prm.NH * half);
    let pos = min(position(t), prm.n_pos - 1u);
    let j = i % half;  // pair within the head
    let i0 = (i / half) * prm.D + select(2u * j, j, NEOX);
    let i1 = i0 + select(1u, half, NEOX);
    let cs = CS[pos * half + j];
    let s = prm.sign * cs.y;
    let x0 = X[i0];
    let x1 = X[i1];
    Y[i0] = x0 * cs.x - x1 * s;
    Y[i1] = x0 * s + x1 * cs.x;
}
