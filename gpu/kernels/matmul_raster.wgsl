// Raster order of a GEMM's workgroup tiles (include; the kernel defines const GROUP_M): GROUP_M workgroup rows
// sweep the columns together, so the weight tiles they share stay in L2; GROUP_M = 0 is plain row-major order.
// Returns (tile index along M, tile index along the output columns).
fn raster(wg: vec3<u32>, nwg: vec3<u32>) -> vec2<u32> {
    if (GROUP_M == 0u) {
        return vec2<u32>(wg.y, wg.x);
    }
    let pid = wg.y * nwg.x + wg.x;
    let width = GROUP_M * nwg.x;
    let first = (pid / width) * GROUP_M;
    let rows = min(nwg.y - first, GROUP_M);
    return vec2<u32>(first + (pid % width) % rows, (pid % width) / rows);
}
