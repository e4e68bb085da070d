// Term of reduce_sum.wgsl: the f32 values themselves (loss totals).

@group(0) @binding(1) var<storage, read> X: array<f32>;

fn term(i: u32) -> f32 {
    return X[i];
}
