// Philox4x32-10 words of arbitrary (counter, key) pairs, one thread each (threads.wgsl): the generator alone,
// for tests against model/sampled.py (gpu/ops/sampled.py philox_words).

struct Params {
    n: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Counters: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> Keys: array<vec2<u32>>;
@group(0) @binding(3) var<storage, read_write> Words: array<vec4<u32>>;

const WG: u32 = 64u;

fn n_items() -> u32 {
    return prm.n;
}

fn item(i: u32) {
    Words[i] = philox4x32(Counters[i], Keys[i]);
}
