// Position of rope.wgsl's row t: the offset plus the row index (one contiguous sequence).

fn position(t: u32) -> u32 {
    return prm.start + t;
}
