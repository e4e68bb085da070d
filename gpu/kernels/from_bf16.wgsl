// Elementwise body (elementwise.wgsl), over n pairs: the f32 values of to_bf16's words (exact: bf16 is the top
// half of an f32), Y[2 i] = low half of W[i], Y[2 i + 1] = its high half.

@group(0) @binding(1) var<storage, read> W: array<u32>;
@group(0) @binding(2) var<storage, read_write> Y: array<vec2<f32>>;

fn op(i: u32) {
    let w = W[i];
    Y[i] = vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));
}
