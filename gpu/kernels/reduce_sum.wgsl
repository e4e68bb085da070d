// Deterministic sum of n terms by one workgroup: Out[out_index] = alpha * sum_i term(i). Thread t sums
// i = t, t + 256, ... in order, then workgroup_reduce.wgsl's fixed tree combines the 256 partials. The term
// comes from the body file after this one, which binds the input X at @binding(1) and defines
// `fn term(i: u32) -> f32`: reduce_term_value.wgsl (X[i]) or reduce_term_nonzero.wgsl (1 per nonzero entry).

struct Params {
    n: u32,
    out_index: u32,
    alpha: f32,
    _pad: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(2) var<storage, read_write> Out: array<f32>;

const WG: u32 = 256u;
alias Reduced = f32;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    var s = 0.0;
    for (var i = lid; i < prm.n; i += WG) {
        s += term(i);
    }
    let total = workgroup_reduce(lid, s);
    if (lid == 0u) {
        Out[prm.out_index] = prm.alpha * total;
    }
}
