// A in f16 bound as array<vec2<u32>> (4 halves a element; lda, a_off and the binding multiples of 4).
// a_at: element i; a_vec4 / a_vec8: 4 / 8 elements from i (i % 4 == 0).
fn a_at(i: u32) -> f16 {
    return ${H2}(A[i >> 2u][(i >> 1u) & 1u])[i & 1u];
}

fn a_vec4(i: u32) -> vec4<f16> {
    return ${H4}(A[i >> 2u]);
}

fn a_vec8(i: u32) -> H8 {
    return H8(${H4}(A[i >> 2u]), ${H4}(A[(i >> 2u) + 1u]));
}
