// 8 bytes of a weight bound as array<u32> from an even byte offset b, as two little-endian words: three
// loads and no branch (at a word-aligned b the third word is read and unused; the data's last 8 bytes
// then reach into the binding's padding word).
fn w_bytes8(b: u32) -> vec2<u32> {
    let i = b >> 2u;
    let w0 = W[i];
    let w1 = W[i + 1u];
    let w2 = W[i + 2u];
    let odd = (b & 2u) != 0u;
    return vec2<u32>(select(w0, (w0 >> 16u) | (w1 << 16u), odd), select(w1, (w1 >> 16u) | (w2 << 16u), odd));
}
