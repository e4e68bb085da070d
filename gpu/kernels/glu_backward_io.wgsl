${ENABLE_F16}
// The gated units' backward (swiglu_backward.wgsl, geglu_backward.wgsl; first in the source: the f16 directive must
// be): its bindings, and store_grads, which writes dG, dU over U and, in variant half, both as f16 (DG16, DU16).

@group(0) @binding(1) var<storage, read> dY: array<f32>;
@group(0) @binding(2) var<storage, read> G: array<f32>;
@group(0) @binding(3) var<storage, read_write> U: array<f32>;
@group(0) @binding(4) var<storage, read_write> dG: array<f32>;
${HALF_BINDINGS}

fn store_grads(i: u32, dg: f32, du: f32) {
    dG[i] = dg;
    U[i] = du;
    ${HALF_STORES}
}
