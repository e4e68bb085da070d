// The fused RMSNorms' workgroup (rmsnorm_i8.wgsl, rmsnorm_i8_units.wgsl): 64 invocations a row, and
// workgroup_reduce.wgsl's tree on pairs: the sum of squares in x, the absmax in y.
const WG: u32 = 64u;
alias Reduced = vec2<f32>;   // (sum of squares, absmax)

fn combine(a: Reduced, b: Reduced) -> Reduced {
    return vec2<f32>(a.x + b.x, max(a.y, b.y));
}
