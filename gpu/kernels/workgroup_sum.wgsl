// The combine of workgroup_reduce.wgsl for sums (Reduced = f32, or a vector of them summed componentwise).

fn combine(a: Reduced, b: Reduced) -> Reduced {
    return a + b;
}
