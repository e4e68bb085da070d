"""Device layer: buffers, limits, caches, recording order (lavapipe in CI)."""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest

from gpu.device import BufferView, Device, DeviceError, grid_1d
from tests.gpu_fixtures import device_or_skip

pytestmark = pytest.mark.gpu


@pytest.fixture
def dev() -> Device:
    return device_or_skip()


SCALE_WGSL = """
@group(0) @binding(0) var<uniform> prm: vec4<f32>;   // x: factor, y: bitcast count
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    if (g.x < bitcast<u32>(prm.y)) { dst[g.x] = prm.x * src[g.x]; }
}
"""


def _scale_params(factor: float, n: int) -> np.ndarray:
    return np.array([factor, np.uint32(n).view(np.float32), 0, 0], np.float32)


def _scale(dev: Device, src, dst, factor: float, n: int) -> None:
    pipe = dev.pipeline(("test_scale",), lambda: SCALE_WGSL)
    dev.dispatch(pipe, [_scale_params(factor, n), src, dst], grid=-(-n // 64))


def test_describe_and_max_limits(dev: Device) -> None:
    d = dev.describe()
    assert d["backend"] in ("wgpu-native", "dawn")
    assert d["adapter"] == dev.adapter.summary
    for name in ("max-storage-buffer-binding-size", "max-buffer-size", "max-compute-workgroup-storage-size"):
        assert d["limits"][name] == dev.adapter.limits[name], name  # requested at the adapter maximum
    assert "shader-f16" in d["features"] or "shader-f16" not in dev.adapter.features


@pytest.mark.tensorcore
def test_dawn_reports_the_gpu_memory() -> None:
    """Dawn reports the GPU's device-local heap (the memory-for-speed choices' budget): more than 8 GiB on the H200
    and H100 this runs on, the same on a second call; describe() carries it."""
    from tests.gpu_fixtures import tensor_core_device_or_skip

    tc = tensor_core_device_or_skip()
    memory = tc.memory_bytes()
    assert memory is not None and memory > 8 << 30 and tc.memory_bytes() == memory
    assert tc.describe()["memory_bytes"] == memory


def test_cpu_adapter_warns(dev: Device) -> None:
    if not dev.is_cpu:
        pytest.skip("warning only applies to CPU adapters")
    with pytest.warns(RuntimeWarning, match="CPU adapter"):
        Device(backend="wgpu")


def test_bad_backend_names_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTILLERY_BACKEND", "cuda")
    with pytest.raises(DeviceError, match="DISTILLERY_BACKEND"):
        Device()


def test_gpu_index_picks_among_adapters_of_the_best_kind(dev: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """DISTILLERY_GPU_INDEX (set by a Ray worker from its assigned GPU): 0 is the first adapter of the best kind;
    an index past them, or not a number, is a one-line error naming the variable."""
    monkeypatch.setenv("DISTILLERY_GPU_INDEX", "0")
    assert Device(dev.backend).adapter.summary == dev.adapter.summary
    monkeypatch.setenv("DISTILLERY_GPU_INDEX", "7")
    with pytest.raises(DeviceError, match=r"DISTILLERY_GPU_INDEX=7: \w+ lists \d+ adapter"):
        Device(dev.backend)
    monkeypatch.setenv("DISTILLERY_GPU_INDEX", "first")
    with pytest.raises(DeviceError, match="DISTILLERY_GPU_INDEX='first': expected a GPU index"):
        Device(dev.backend)


def test_buffer_limit_errors_say_the_numbers(dev: Device) -> None:
    too_big = (dev.max_buffer // 4 + 1) * 4
    with pytest.raises(DeviceError, match=rf"'huge'.*{too_big} bytes.*max buffer size of {dev.max_buffer} bytes"):
        dev.buffer(too_big, label="huge")
    if dev.max_binding < dev.max_buffer:
        too_wide = (dev.max_binding // 4 + 1) * 4
        with pytest.raises(DeviceError, match=rf"'big'.*{too_wide} bytes.*storage binding of {dev.max_binding} bytes"):
            dev.buffer(too_wide, label="big")
    with pytest.raises(DeviceError, match="max storage binding"):
        dev.check_binding(dev.max_binding + 1, "tensor 'x'")
    dev.check_binding(dev.max_binding)


def test_upload_read_roundtrip_odd_sizes(dev: Device) -> None:
    rng = np.random.default_rng(1)
    for arr in (
        rng.integers(0, 255, 5, dtype=np.uint8),
        rng.standard_normal((3, 7)).astype(np.float32),
        rng.standard_normal(9).astype(np.float16),
    ):
        buf = dev.upload(arr, label="rt")
        assert buf.size % 4 == 0 and buf.size >= arr.nbytes
        np.testing.assert_array_equal(dev.read(buf, arr.dtype, arr.shape), arr)


def test_uploads_wait_every_write_sync_bytes(dev: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host writes outside a step wait for the GPU after every write_sync_bytes (so their staging is freed), and
    a read (which waits anyway) starts the count again; the data arrives either way."""
    monkeypatch.setattr(dev, "write_sync_bytes", 1000)
    dev.sync()
    before = dev.stats["write_syncs"]
    arrays = [np.full(100, i, np.float32) for i in range(7)]  # 400 bytes each
    bufs = [dev.upload(a, label="sync") for a in arrays]
    assert dev.stats["write_syncs"] - before == 2  # after 1,200 and 2,400 bytes
    np.testing.assert_array_equal(dev.read(bufs[-1], np.float32, 100), arrays[-1])
    dev.upload(arrays[0], label="sync")
    dev.upload(arrays[0], label="sync")  # 800 bytes since the read: no wait
    assert dev.stats["write_syncs"] - before == 2
    for buf, a in zip(bufs, arrays, strict=True):
        np.testing.assert_array_equal(dev.read(buf, np.float32, 100), a)


def test_pipeline_cache_hit_compiles_once(dev: Device) -> None:
    calls = []

    def src() -> str:
        calls.append(1)
        return SCALE_WGSL

    p1 = dev.pipeline(("test_cache", 1), src)
    p2 = dev.pipeline(("test_cache", 1), src)
    p3 = dev.pipeline(("test_cache", 2), src)
    assert p1 is p2 and p3 is not p1
    assert len(calls) == 2


def test_compile_error_names_the_kernel(dev: Device) -> None:
    with pytest.raises(DeviceError, match="test_broken"):
        dev.pipeline(("test_broken",), lambda: "fn main( {")


def test_bind_group_and_uniform_caches(dev: Device) -> None:
    pipe = dev.pipeline(("test_scale",), lambda: SCALE_WGSL)
    a, b, c = dev.buffer(256, label="a"), dev.buffer(256, label="b"), dev.buffer(256, label="c")
    prm = _scale_params(2.0, 64)
    g1 = dev.bind_group(pipe, [prm, a, b])
    assert dev.bind_group(pipe, [prm.copy(), a, b]) is g1  # equal uniform content -> same uniform buffer
    assert dev.uniform(prm) is dev.uniform(prm.tobytes())
    assert dev.bind_group(pipe, [prm, a, c]) is not g1
    assert dev.bind_group(pipe, [prm, BufferView(a, 0, 128), b]) is not g1
    gc.collect()  # buffers earlier tests left in reference cycles go first: only c's entry may go below
    n = len(dev._bind_groups)
    del c
    gc.collect()
    assert len(dev._bind_groups) == n - 1  # entries of a collected buffer are dropped


def test_misaligned_view_is_an_error(dev: Device) -> None:
    pipe = dev.pipeline(("test_scale",), lambda: SCALE_WGSL)
    a = dev.buffer(1024)
    with pytest.raises(DeviceError, match="offset 4"):
        dev.bind_group(pipe, [_scale_params(1.0, 4), BufferView(a, 4, 16), a])


def test_long_step_submits_in_chunks_in_order(dev: Device) -> None:
    """A step of more than submit_every dispatches submits every submit_every of them (so the GPU starts early),
    still in recording order: each dispatch reads what the previous one wrote."""
    x = np.arange(64, dtype=np.float32)
    bufs = [dev.upload(x)] + [dev.buffer(256) for _ in range(5)]
    before, old = dev.stats["submits"], dev.submit_every
    dev.submit_every = 2
    try:
        with dev.step():
            for i in range(5):
                _scale(dev, bufs[i], bufs[i + 1], 2.0, 64)
    finally:
        dev.submit_every = old
    assert dev.stats["submits"] == before + 3  # after dispatches 2 and 4, then the step's end
    np.testing.assert_array_equal(dev.read(bufs[5], np.float32, 64), 32 * x)


def test_tape_replays_dispatches_copies_and_clears(dev: Device) -> None:
    """A tape replays its step's commands on the buffers' current contents; a step that wrote host data (or
    read back) is not replayable."""
    x = np.arange(64, dtype=np.float32)
    a, b, c = dev.upload(x), dev.buffer(256), dev.buffer(256)
    with dev.step(), dev.taping() as tape:
        _scale(dev, a, b, 2.0, 64)
        dev.copy(b, c, 256)
        dev.clear(b, 0, 128)
    assert tape.replayable and len(tape.commands) == 3
    dev.write(a, 3 * x)
    dev.replay(tape)
    np.testing.assert_array_equal(dev.read(c, np.float32, 64), 6 * x)
    np.testing.assert_array_equal(dev.read(b, np.float32, 64), np.r_[np.zeros(32), 6 * x[32:]])
    with dev.step(), dev.taping() as tape:
        dev.write(a, x)
    assert not tape.replayable
    with pytest.raises(DeviceError, match="cannot be replayed"):
        dev.replay(tape)


def test_step_records_in_order_and_submits_once(dev: Device) -> None:
    x = np.arange(100, dtype=np.float32)
    bx, by, bz = dev.upload(x), dev.buffer(400), dev.buffer(400)
    before = dev.stats["submits"]
    with dev.step():
        _scale(dev, bx, by, 2.0, 100)
        _scale(dev, by, bz, 3.0, 100)  # reads what the previous dispatch wrote
        dev.write(bx, np.full(100, 7, np.float32))  # ordered after the first dispatch
        _scale(dev, bx, by, 1.0, 100)
    assert dev.stats["submits"] == before + 1
    np.testing.assert_array_equal(dev.read(bz, np.float32, 100), 6 * x)
    np.testing.assert_array_equal(dev.read(by, np.float32, 100), np.full(100, 7, np.float32))


def test_read_inside_step_flushes_and_error_discards(dev: Device) -> None:
    x = np.arange(64, dtype=np.float32)
    bx, by = dev.upload(x), dev.buffer(256)
    with dev.step():
        _scale(dev, bx, by, 5.0, 64)
        np.testing.assert_array_equal(dev.read(by, np.float32, 64), 5 * x)
        _scale(dev, bx, by, -1.0, 64)
    np.testing.assert_array_equal(dev.read(by, np.float32, 64), -x)
    with pytest.raises(ZeroDivisionError), dev.step():
        _scale(dev, bx, by, 9.0, 64)
        1 / 0  # noqa: B018
    np.testing.assert_array_equal(dev.read(by, np.float32, 64), -x)  # nothing of the failed step ran


def test_grid_1d_and_dispatch_limit(dev: Device) -> None:
    assert grid_1d(10) == (10, 1, 1)
    for n in (65536, 3 * 65535 + 1, 10**7):
        x, y, z = grid_1d(n)
        assert x * y >= n and max(x, y) <= 65535 and z == 1
        assert (x - 1) * y < n  # not grossly oversized
    pipe = dev.pipeline(("test_scale",), lambda: SCALE_WGSL)
    a = dev.buffer(256)
    with pytest.raises(DeviceError, match="per dimension"):
        dev.dispatch(pipe, [_scale_params(1.0, 1), a, a], grid=(70000, 1))


def test_dawn_request_fails_clearly_without_dawn_adapter(dev: Device) -> None:
    if dev.backend == "dawn" or not dev.is_cpu:
        pytest.skip("a Dawn adapter may exist here")
    with warnings.catch_warnings(), pytest.raises(DeviceError, match="dawn"):
        warnings.simplefilter("ignore")
        Device(backend="dawn")


def test_clear_and_copy_are_ordered_in_a_step(dev: Device) -> None:
    x = np.arange(1, 65, dtype=np.float32)
    bx, by, bz = dev.upload(x), dev.buffer(256), dev.buffer(256)
    with dev.step():
        _scale(dev, bx, by, 2.0, 64)
        dev.copy(by, bz, 128, src_offset=0, dst_offset=128)  # z[32:] = y[:32]
        dev.clear(by, 0, 128)  # y[:32] = 0, after the copy read it
    np.testing.assert_array_equal(dev.read(bz, np.float32, 64), np.r_[np.zeros(32), 2 * x[:32]])
    np.testing.assert_array_equal(dev.read(by, np.float32, 64), np.r_[np.zeros(32), 2 * x[32:]])


def test_memory_accounting_by_label(dev: Device) -> None:
    """live/peak bytes add up by label (numbers folded), the peak's snapshot included; freed buffers leave."""
    base_live = dev.live_bytes
    size = max(1 << 20, -(-(dev.peak_bytes - base_live + 4) // 3 // 4) * 4)  # three of them make a new peak
    bufs = [dev.buffer(size, label=f"blk.{i}.probe_w") for i in range(3)]
    assert dev.live_by_label["blk.#.probe_w"] == 3 * size and dev.live_bytes == base_live + 3 * size
    assert dev.peak_bytes == dev.live_bytes and dev.peak_by_label["blk.#.probe_w"] == 3 * size
    assert sum(dev.peak_by_label.values()) == dev.peak_bytes
    del bufs
    gc.collect()
    assert dev.live_by_label["blk.#.probe_w"] == 0 and dev.live_bytes == base_live
