${ENABLE_F16}
// Elementwise body (elementwise.wgsl): a gated unit's forward, Y = act(G) * U, with ${GATE} act(g) of g = G[i]:
// SwiGLU's silu(g) = g * sigmoid(g), GeGLU's gelu_tanh(g) (gelu_tanh.wgsl); variant half: also Y16 = f16(Y),
// the f16 A operand of the down projection's tensor-core GEMM. (This body goes first in the source: the f16
// directive must.)

@group(0) @binding(1) var<storage, read> G: array<f32>;
@group(0) @binding(2) var<storage, read> U: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
${Y16_BINDING}

fn op(i: u32) {
    let g = G[i];
    let y = ${GATE} * U[i];
    Y[i] = y;
    ${Y16_STORE}
}
