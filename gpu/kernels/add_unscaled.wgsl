// Elementwise body (elementwise.wgsl): Y (+)= B / sigma with sigma = grad_scale(stats[0]) (grad_scale.wgsl):
// a product computed from an operand packed to f16 times sigma (pack_f16.wgsl SCALED), brought back to scale.
// ACC: add to Y, else overwrite it. Dividing by a power of two is exact.

@group(0) @binding(1) var<storage, read> B: array<f32>;
@group(0) @binding(2) var<storage, read> stats: array<u32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;

const ACC: bool = ${ACC};

fn op(i: u32) {
    let y = B[i] / grad_scale(stats[0]);
    if (ACC) {
        Y[i] = Y[i] + y;
    } else {
        Y[i] = y;
    }
}
