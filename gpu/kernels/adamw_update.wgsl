// Elementwise body (elementwise.wgsl): AdamW update over a flat f32 parameter buffer (PyTorch semantics,
// decoupled weight decay), skipped entirely when Stats[2] (non-finite loss or grad norm) is set. With
// g = G * clip_scale:
//   p *= 1 - lr * wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// Hp = (lr, b1, b2, eps, 1 - lr * wd, lr / bc1, 1 / sqrt(bc2), 0), written by the host each step (bias
// corrections in float64 there).

@group(0) @binding(1) var<storage, read> Hp: array<f32>;
@group(0) @binding(2) var<storage, read> Stats: array<f32>;
@group(0) @binding(3) var<storage, read> G: array<f32>;
@group(0) @binding(4) var<storage, read_write> P: array<f32>;
@group(0) @binding(5) var<storage, read_write> M: array<f32>;
@group(0) @binding(6) var<storage, read_write> V: array<f32>;

fn op(i: u32) {
    if (Stats[2] != 0.0) {
        return;
    }
    let b1 = Hp[1];
    let b2 = Hp[2];
    let g = G[i] * Stats[1];
    let m = b1 * M[i] + (1.0 - b1) * g;
    let v = b2 * V[i] + (1.0 - b2) * g * g;
    M[i] = m;
    V[i] = v;
    let denom = sqrt(v) * Hp[6] + Hp[3];
    P[i] = P[i] * Hp[4] - Hp[5] * (m / denom);
}
