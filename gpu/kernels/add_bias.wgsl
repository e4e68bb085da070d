// Elementwise body (elementwise.wgsl): a frozen bias added to every row of a projection's output,
// Y[r, j] += B[j] with rows of prm.width (qwen2's q/k/v biases). Its gradient is never needed (frozen) and dX
// does not depend on it.

@group(0) @binding(1) var<storage, read> B: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;

fn op(i: u32) {
    Y[i] = Y[i] + B[i % prm.width];
}
