// Global grad norm, pass 2 (one workgroup): norm = sqrt(sum of the partials: strided per-thread sums, then
// workgroup_reduce.wgsl's fixed tree), the clipping scale min(1, max_norm / (norm + 1e-6)) (1 when
// max_norm <= 0), and the skip flag: 1 when the norm or any of the losses Loss[0..=loss_index] (every micro-batch
// of an accumulated step) is not finite. Stats = (norm, scale, skipped, Loss[loss_index]); the host reads it once
// per step and counts skips.

struct Params {
    n_partials: u32,
    loss_index: u32,
    max_norm: f32,
    _pad: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Partial: array<f32>;
@group(0) @binding(2) var<storage, read> Loss: array<f32>;
@group(0) @binding(3) var<storage, read_write> Stats: array<f32>;

const WG: u32 = 256u;
alias Reduced = f32;

fn is_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7F800000u) != 0x7F800000u;
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    var s = 0.0;
    for (var i = lid; i < prm.n_partials; i += WG) {
        s += Partial[i];
    }
    let total = workgroup_reduce(lid, s);
    if (lid == 0u) {
        let norm = sqrt(total);
        let loss = Loss[prm.loss_index];
        var losses_finite = true;
        for (var i = 0u; i <= prm.loss_index; i++) {
            losses_finite = losses_finite && is_finite(Loss[i]);
        }
        var scale = 1.0;
        if (prm.max_norm > 0.0) {
            scale = min(1.0, prm.max_norm / (norm + 1e-6));
        }
        let skip = !(is_finite(norm) && losses_finite);
        Stats[0] = norm;
        Stats[1] = select(scale, 0.0, skip);
        Stats[2] = select(0.0, 1.0, skip);
        Stats[3] = loss;
    }
}
