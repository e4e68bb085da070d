// Online logsumexp (include): a state (m, s) stands for m + log(s), s = sum of exp(x - m) over the values seen.

// The state of two partial states together.
fn lse_merge(ma: f32, sa: f32, mb: f32, sb: f32) -> vec2<f32> {
    let m = max(ma, mb);
    return vec2<f32>(m, sa * exp(ma - m) + sb * exp(mb - m));
}
