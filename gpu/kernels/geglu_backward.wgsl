// Elementwise body (elementwise.wgsl): GeGLU backward, dG = dY * U * gelu'(g), dU = dY * gelu(g) (gelu_tanh.wgsl).
// dU overwrites U (each invocation reads U[i] before writing it), as swiglu_backward does.

@group(0) @binding(1) var<storage, read> dY: array<f32>;
@group(0) @binding(2) var<storage, read> G: array<f32>;
@group(0) @binding(3) var<storage, read_write> U: array<f32>;
@group(0) @binding(4) var<storage, read_write> dG: array<f32>;

fn op(i: u32) {
    let f = gelu_tanh(G[i]);
    let dy = dY[i];
    dG[i] = dy * U[i] * f.y;
    U[i] = dy * f.x;
}
