// Position of rope.wgsl's row t: the offset plus positions[t] (packed batches, shuffled rows).

@group(0) @binding(4) var<storage, read> positions: array<u32>;

fn position(t: u32) -> u32 {
    return prm.start + positions[t];
}
