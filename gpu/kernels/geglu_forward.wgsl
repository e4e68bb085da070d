${ENABLE_F16}
// Elementwise body (elementwise.wgsl): GeGLU forward, Y = gelu_tanh(G) * U (gelu_tanh.wgsl); variant half: also
// Y16 = f16(Y), the f16 A operand of the down projection's tensor-core GEMM. (This body goes first in the
// source: the f16 directive must.)

@group(0) @binding(1) var<storage, read> G: array<f32>;
@group(0) @binding(2) var<storage, read> U: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
${Y16_BINDING}

fn op(i: u32) {
    let y = gelu_tanh(G[i]).x * U[i];
    Y[i] = y;
    ${Y16_STORE}
}
