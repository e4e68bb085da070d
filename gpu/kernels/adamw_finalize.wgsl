// Global grad norm, pass 2 (one workgroup): norm = sqrt(sum of the partials, fixed order), the clipping
// scale min(1, max_norm / (norm + 1e-6)) (1 when max_norm <= 0), and the skip flag: 1 when the loss or the
// norm is not finite. Stats = (norm, scale, skipped, loss); the host reads it once per step and counts skips.

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

var<workgroup> red: array<f32, 256>;

fn is_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7F800000u) != 0x7F800000u;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32) {
    var s = 0.0;
    for (var i = lid; i < prm.n_partials; i += 256u) {
        s += Partial[i];
    }
    red[lid] = s;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w >>= 1u) {
        if (lid < w) {
            red[lid] += red[lid + w];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        let norm = sqrt(red[0]);
        let loss = Loss[prm.loss_index];
        var scale = 1.0;
        if (prm.max_norm > 0.0) {
            scale = min(1.0, prm.max_norm / (norm + 1e-6));
        }
        let skip = !(is_finite(norm) && is_finite(loss));
        Stats[0] = norm;
        Stats[1] = select(scale, 0.0, skip);
        Stats[2] = select(0.0, 1.0, skip);
        Stats[3] = loss;
    }
}
