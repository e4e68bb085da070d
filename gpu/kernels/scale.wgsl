// Elementwise body (elementwise.wgsl): in-place scale, Y *= alpha (e.g. gradients averaged over accumulated
// micro-batches).

@group(0) @binding(1) var<storage, read_write> Y: array<f32>;

fn op(i: u32) {
    Y[i] = Y[i] * prm.alpha;
}
