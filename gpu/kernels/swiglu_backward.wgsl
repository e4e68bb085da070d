${ENABLE_F16}
// Elementwise body (elementwise.wgsl): SwiGLU backward, dG = dY * U * sig * (1 + g * (1 - sig)),
// dU = dY * g * sig with sig = sigmoid(g). dU overwrites U (each invocation reads U[i] before writing it):
// the training step needs no separate [rows, ffn] buffer for it. Variant half: also both as f16 (DG16, DU16), the
// gate and up projections' tensor-core input-gradient operands. (This body goes first: the f16 directive must.)

@group(0) @binding(1) var<storage, read> dY: array<f32>;
@group(0) @binding(2) var<storage, read> G: array<f32>;
@group(0) @binding(3) var<storage, read_write> U: array<f32>;
@group(0) @binding(4) var<storage, read_write> dG: array<f32>;
${HALF_BINDINGS}

fn op(i: u32) {
    let g = G[i];
    let dy = dY[i];
    let sig = sigmoid(g);
    let dg = dy * U[i] * sig * (1.0 + g * (1.0 - sig));
    let du = dy * g * sig;
    dG[i] = dg;
    U[i] = du;
    ${HALF_STORES}
}
