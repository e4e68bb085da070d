// Philox4x32-10 (include), model/sampled.py's generator in u32 arithmetic: the 32x32 -> 64 products from four
// 16-bit products (WGSL has no 64-bit integers). Bit for bit model/sampled.py's philox4x32 (tests/test_gpu_sampled.py
// checks Random123's known answers and the draw vectors).

const PHILOX_M0: u32 = 0xD2511F53u;
const PHILOX_M1: u32 = 0xCD9E8D57u;
const PHILOX_W0: u32 = 0x9E3779B9u;
const PHILOX_W1: u32 = 0xBB67AE85u;

// The high 32 bits of the 64-bit product a * b (the low half is a * b in u32, which wraps).
fn mul_hi(a: u32, b: u32) -> u32 {
    let a0 = a & 0xFFFFu;
    let a1 = a >> 16u;
    let b0 = b & 0xFFFFu;
    let b1 = b >> 16u;
    let ll = a0 * b0;
    let lh = a0 * b1;
    let hl = a1 * b0;
    let cross = (ll >> 16u) + (lh & 0xFFFFu) + (hl & 0xFFFFu);  // < 3 * 2^16
    return a1 * b1 + (lh >> 16u) + (hl >> 16u) + (cross >> 16u);
}

// Philox4x32-10 of counter c under key k.
fn philox4x32(counter: vec4<u32>, key: vec2<u32>) -> vec4<u32> {
    var c = counter;
    var k = key;
    for (var r = 0u; r < 10u; r++) {
        if (r > 0u) {
            k = k + vec2<u32>(PHILOX_W0, PHILOX_W1);
        }
        let hi0 = mul_hi(PHILOX_M0, c.x);
        let lo0 = PHILOX_M0 * c.x;
        let hi1 = mul_hi(PHILOX_M1, c.z);
        let lo1 = PHILOX_M1 * c.z;
        c = vec4<u32>(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return c;
}
