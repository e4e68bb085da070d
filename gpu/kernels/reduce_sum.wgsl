// Deterministic sum of n terms by one workgroup: Out[out_index] = alpha * sum_i ${TERM} with x = X[i].
// Thread t sums i = t, t + 256, ... in order, then a fixed tree combines the 256 partials.

struct Params {
    n: u32,
    out_index: u32,
    alpha: f32,
    _pad: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> X: array<${ELEM}>;
@group(0) @binding(2) var<storage, read_write> Out: array<f32>;

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32) {
    var s = 0.0;
    for (var i = lid; i < prm.n; i += 256u) {
        let x = X[i];
        s += ${TERM};
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
        Out[prm.out_index] = prm.alpha * red[0];
    }
}
