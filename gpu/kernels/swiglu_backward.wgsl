// Elementwise body (elementwise.wgsl, glu_backward_io.wgsl): SwiGLU backward, dG = dY * U * sig * (1 + g (1 - sig)),
// dU = dY * g * sig with sig = sigmoid(g). dU overwrites U (each invocation reads U[i] before writing it):
// the training step needs no separate [rows, ffn] buffer for it. Variant half: also both as f16, the gate and up
// projections' tensor-core input-gradient operands.

fn op(i: u32) {
    let g = G[i];
    let dy = dY[i];
    let sig = sigmoid(g);
    store_grads(i, dy * U[i] * sig * (1.0 + g * (1.0 - sig)), dy * g * sig);
}
