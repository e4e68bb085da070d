// Elementwise body (elementwise.wgsl): in-place accumulate, Y += B.

@group(0) @binding(1) var<storage, read> B: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;

fn op(i: u32) {
    Y[i] = Y[i] + B[i];
}
