// Elementwise body (elementwise.wgsl): SwiGLU backward, dG = dY * U * sig * (1 + g * (1 - sig)),
// dU = dY * g * sig with sig = sigmoid(g). dU overwrites U (each invocation reads U[i] before writing it):
// the training step needs no separate [rows, ffn] buffer for it.

@group(0) @binding(1) var<storage, read> dY: array<f32>;
@group(0) @binding(2) var<storage, read> G: array<f32>;
@group(0) @binding(3) var<storage, read_write> U: array<f32>;
@group(0) @binding(4) var<storage, read_write> dG: array<f32>;

fn op(i: u32) {
    let g = G[i];
    let dy = dY[i];
    let sig = sigmoid(g);
    dG[i] = dy * U[i] * sig * (1.0 + g * (1.0 - sig));
    U[i] = dy * g * sig;
}
