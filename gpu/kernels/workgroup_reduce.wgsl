// Fixed-order workgroup reduction (include). Each of the WG threads passes one partial value; a tree combines
// them (for w = WG/2, ..., 1: thread t < w folds slot t + w into slot t) and every thread gets the total. The
// same tree on the same partials gives the same bits on every run: the kernels' sums are reproducible.
// The kernel defines `const WG: u32` (its workgroup size, a power of two), `alias Reduced = ...;` (the value
// type) and `fn combine(a: Reduced, b: Reduced) -> Reduced` (workgroup_sum.wgsl: the sum; logsumexp states
// define their own). Call it from uniform control flow, once per invocation.

var<workgroup> red: array<Reduced, WG>;

fn workgroup_reduce(lid: u32, x: Reduced) -> Reduced {
    red[lid] = x;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w >>= 1u) {
        if (lid < w) {
            red[lid] = combine(red[lid], red[lid + w]);
        }
        workgroupBarrier();
    }
    return red[0];
}
