"""The tensor-core attention kernels' tile staging (gpu/codegen_attention_tc.py _staging_fns) on any adapter with
f16: a BC x D tile of packed f16 rows put into the 16-row workgroup blocks, in order and in rotated order
(the bank-conflict-free variant), must give the same blocks, each row's D halves at its LDH stride. Exact.
wgpu-native's shader compiler types `bitcast<vecN<f16>>` of u32s wrongly, so the test swaps those bitcasts for
unpack2x16float and an (exact) f16 conversion: what it checks is where each half goes."""

from __future__ import annotations

import numpy as np
import pytest

from gpu.codegen_attention_tc import _staging_fns, tile_columns
from gpu.device import Device
from tests.gpu_helpers import make_device

pytestmark = pytest.mark.gpu
THREADS = 128


@pytest.fixture(scope="module")
def dev() -> Device:
    return make_device()


def _portable(wgsl: str) -> str:
    """The staging functions with their f16 bitcasts through b2h / b4h (see the module docstring)."""
    out = wgsl.replace("bitcast<vec2<f16>>(", "b2h(").replace("bitcast<vec4<f16>>(", "b4h(")
    assert "bitcast" not in out
    return out


def _source(head_dim: int, bc: int, rotate: bool) -> str:
    """A kernel that stages one tile of K16 (one head) into Ks through put_Ks and copies Ks out as f32."""
    return f"""enable f16;
const D: u32 = {head_dim}u;
const BC: u32 = {bc}u;
const NB: u32 = BC / 16u;
const LDH: u32 = D + 8u;
const THREADS: u32 = {THREADS}u;
@group(0) @binding(0) var<storage, read> K16: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> Out: array<f32>;
var<workgroup> Ks: array<array<f16, 16 * LDH>, NB>;
fn b2h(w: u32) -> vec2<f16> {{
    let v = unpack2x16float(w);
    return vec2<f16>(f16(v.x), f16(v.y));
}}
fn b4h(w: vec2<u32>) -> vec4<f16> {{
    return vec4<f16>(b2h(w.x), b2h(w.y));
}}
{_portable(_staging_fns([], [("Ks", "K16")], rotate))}

@compute @workgroup_size({THREADS})
fn main(@builtin(local_invocation_index) lid: u32) {{
    for (var u = lid; u < BC * D / 8u; u += THREADS) {{
        put_Ks(u, load_K16(0u, 0u, 1u, u));
    }}
    workgroupBarrier();
    for (var i = lid; i < NB * 16u * LDH; i += THREADS) {{
        Out[i] = f32(Ks[i / (16u * LDH)][i % (16u * LDH)]);
    }}
}}
"""


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kernel", ["forward", "dkv"])
def test_rotated_staging_stores_the_same_tile(dev: Device, head_dim: int, kernel: str) -> None:
    bc = tile_columns(kernel, head_dim)
    tile = np.random.default_rng(head_dim + bc).standard_normal((bc, head_dim)).astype(np.float16)
    ldh = head_dim + 8
    want = tile.astype(np.float32)
    src = dev.upload(tile.view(np.uint32).reshape(-1))
    got = {}
    for rotate in (False, True):
        out = dev.buffer(4 * bc * ldh)
        pipe = dev.pipeline(("staging test", head_dim, bc, rotate), lambda r=rotate: _source(head_dim, bc, r))
        dev.dispatch(pipe, [src, out], 1)
        got[rotate] = dev.read(out, np.float32, (bc, ldh))[:, :head_dim]  # the padding is never read
    np.testing.assert_array_equal(got[False], want)
    np.testing.assert_array_equal(got[True], want)
