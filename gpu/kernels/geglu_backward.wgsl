// Elementwise body (elementwise.wgsl, glu_backward_io.wgsl): GeGLU backward, dG = dY * U * gelu'(g), dU = dY *
// gelu(g) (gelu_tanh.wgsl). dU overwrites U (each invocation reads U[i] before writing it), as swiglu_backward does;
// variant half as its.

fn op(i: u32) {
    let f = gelu_tanh(G[i]);
    let dy = dY[i];
    store_grads(i, dy * U[i] * f.y, dy * f.x);
}
