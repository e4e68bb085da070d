// A in f16 bound as array<vec4<u32>> (8 halves a element; lda, a_off and the binding multiples of 8).
// a_at: element i; a_vec4 / a_vec8: 4 / 8 elements from i (i % 4 / i % 8 == 0).
fn a_at(i: u32) -> f16 {
    return ${H2}(A[i >> 3u][(i >> 1u) & 3u])[i & 1u];
}

fn a_vec4(i: u32) -> vec4<f16> {
    let q = A[i >> 3u];
    return ${H4}(select(q.xy, q.zw, (i & 4u) != 0u));
}

fn a_vec8(i: u32) -> H8 {
    let q = A[i >> 3u];
    return H8(${H4}(q.xy), ${H4}(q.zw));
}
