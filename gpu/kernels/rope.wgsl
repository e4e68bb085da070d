// NORM RoPE (llama.cpp; adjacent pairs): (y0, y1) = (x0 c - x1 s', x0 s' + x1 c) with s' = sign * sin.
// sign = +1: forward; sign = -1: backward (the transpose of a rotation is the opposite rotation).
// cos/sin come from a table CS[pos, i] = (cos, sin)(pos * base^(-2i/D)) computed in float64 on the host, so
// the angles match the reference exactly. One thread per pair. The position of row t is `fn position(t)`
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
@group(0) @binding(2) var<storage, read> X: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> Y: array<vec2<f32>>;

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
    let cs = CS[pos * half + i % half];
    let s = prm.sign * cs.y;
    let x = X[i];
    Y[i] = vec2<f32>(x.x * cs.x - x.y * s, x.x * s + x.y * cs.x);
}
