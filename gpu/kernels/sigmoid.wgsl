// Overflow-safe logistic function (the elementwise kernels' and glu_i8's).
fn sigmoid(x: f32) -> f32 {
    let e = exp(-abs(x));
    return select(e / (1.0 + e), 1.0 / (1.0 + e), x >= 0.0);
}
