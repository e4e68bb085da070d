// Elementwise body (elementwise.wgsl), the one-pass KD backward's running sum (gpu/ops/kd.py):
// Y[t, :] = Y[t, :] * F[t] + B[t, :] * alpha over rows of prm.width (ACC), or Y = B * alpha (the first chunk).
// B: the chunk's product P_c W_c (alpha 2^-15 undoes the f16 probabilities' scale, exactly); F: kd_probs_*.wgsl's
// rescale of the earlier chunks to the new running max.

@group(0) @binding(1) var<storage, read> B: array<f32>;
@group(0) @binding(2) var<storage, read> F: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;

const ACC: bool = ${ACC};

fn op(i: u32) {
    let y = B[i] * prm.alpha;
    if (ACC) {
        Y[i] = Y[i] * F[i / prm.width] + y;
    } else {
        Y[i] = y;
    }
}
