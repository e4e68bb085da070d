// Elementwise body (elementwise.wgsl): SwiGLU forward, Y = silu(G) * U with silu(g) = g * sigmoid(g).

@group(0) @binding(1) var<storage, read> G: array<f32>;
@group(0) @binding(2) var<storage, read> U: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;

fn op(i: u32) {
    let g = G[i];
    Y[i] = g * sigmoid(g) * U[i];
}
