// W[n, k..k+7] (k % 4 == 0, inside one row) as f16 through the weight type's decode4.
fn w_vec8(n: u32, k: u32, K: u32) -> H8 {
    return H8(vec4<f16>(decode4(n, k, K)), vec4<f16>(decode4(n, k + 4u, K)));
}
