${ENABLE_F16}
// Elementwise body (elementwise.wgsl): GeGLU backward, dG = dY * U * gelu'(g), dU = dY * gelu(g) (gelu_tanh.wgsl).
// dU overwrites U (each invocation reads U[i] before writing it), as swiglu_backward does; variant half as its.

@group(0) @binding(1) var<storage, read> dY: array<f32>;
@group(0) @binding(2) var<storage, read> G: array<f32>;
@group(0) @binding(3) var<storage, read_write> U: array<f32>;
@group(0) @binding(4) var<storage, read_write> dG: array<f32>;
${HALF_BINDINGS}

fn op(i: u32) {
    let f = gelu_tanh(G[i]);
    let dy = dY[i];
    let dg = dy * U[i] * f.y;
    let du = dy * f.x;
    dG[i] = dg;
    U[i] = du;
    ${HALF_STORES}
}
