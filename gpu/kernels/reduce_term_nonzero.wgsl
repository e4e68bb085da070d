// Term of reduce_sum.wgsl: 1 per nonzero u32 entry (mask counts).

@group(0) @binding(1) var<storage, read> X: array<u32>;

fn term(i: u32) -> f32 {
    return select(0.0, 1.0, X[i] != 0u);
}
