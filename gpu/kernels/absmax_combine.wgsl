// The combine of workgroup_reduce.wgsl for a row's absmax (Reduced = f32): the int8 kernels' scales.
alias Reduced = f32;

fn combine(a: Reduced, b: Reduced) -> Reduced {
    return max(a, b);
}
