"""One wgpu device for the whole process: buffers, cached pipelines and bind groups, batched submission.

Works over either wgpu-py backend module: `wgpu` (wgpu-native; Vulkan/Metal/DX12, lavapipe on a CPU) or
`wgpudawn` (Dawn, same API; chosen automatically when it yields an adapter with subgroup matrices, i.e.
tensor cores). Override with `Device(backend="wgpu" | "dawn")` or env DISTILLERY_BACKEND.

Usage::

    import numpy as np
    from gpu.device import Device

    dev = Device()
    x = dev.upload(np.arange(8, dtype=np.float32), label="x")
    y = dev.buffer(8 * 4, label="y")
    src = '''
    @group(0) @binding(0) var<uniform> n: vec4<u32>;
    @group(0) @binding(1) var<storage, read> x: array<f32>;
    @group(0) @binding(2) var<storage, read_write> y: array<f32>;
    @compute @workgroup_size(64)
    fn main(@builtin(global_invocation_id) g: vec3<u32>) { if (g.x < n.x) { y[g.x] = 2.0 * x[g.x]; } }
    '''
    pipe = dev.pipeline(("double", "f32"), lambda: src)   # compiled once per key
    with dev.step():                                       # one encoder, one compute pass, one submit
        params = np.array([8, 0, 0, 0], np.uint32)         # ndarray/bytes binding -> cached uniform buffer
        dev.dispatch(pipe, [params, x, y], grid=1)
    print(dev.read(y, np.float32, (8,)))

Rules of thumb (GPU.md): record a whole training step inside one `dev.step()`; read back only scalars;
a step submits what it recorded every `dev.submit_every` dispatches (default SUBMIT_EVERY on a GPU), so the GPU
works through the first part of a long step while Python still records the rest;
bind groups and uniforms are cached, so re-dispatching the same buffers and shapes costs no allocation.
A binding is a GPUBuffer (bound whole), a `BufferView` (offset/size; offset aligned to
`dev.limits["min-storage-buffer-offset-alignment"]`), or bytes / an ndarray (uniform, cached by content).
Pipelines use layout="auto": pass exactly the bindings the shader uses, in binding order 0, 1, 2, ...
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

MAX_WORKGROUPS_PER_DIM = 65535

# Limits requested at their adapter maximum (everything else stays at the WebGPU default).
_MAX_LIMITS = (
    "max-storage-buffer-binding-size",
    "max-buffer-size",
    "max-compute-workgroup-storage-size",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
    "max-compute-workgroup-size-y",
    "max-compute-workgroup-size-z",
    "max-compute-workgroups-per-dimension",
    "max-storage-buffers-per-shader-stage",
    "max-uniform-buffer-binding-size",
    "max-bind-groups",
    "max-bindings-per-bind-group",
)
# Optional features taken when the adapter has them (wgpu-native spells subgroups "subgroup").
_WANTED_FEATURES = (
    "shader-f16",
    "subgroup",
    "subgroups",
    "timestamp-query",
    "chromium-experimental-subgroup-matrix",
)
SUBGROUP_MATRIX = "chromium-experimental-subgroup-matrix"
# Dispatches per submit inside a step: a step of thousands of dispatches (a training step records 3,500-4,900)
# keeps the GPU busy from the first chunk on instead of idling while the whole step is recorded.
SUBMIT_EVERY = 256
# Host writes outside a step (weight uploads) go through the queue's staging memory, which the runtime frees only
# once a submit after them has completed: wait after this many bytes, so an 8B model's ~4.7 GB of weights do not
# hold as much staging at once (the H200 peaked at 9.6 GB while uploading 4.65 GB of weights without it).
WRITE_SYNC_BYTES = 256 << 20
_DAWN_TOGGLES = ["allow_unsafe_apis", "vulkan_enable_f16_on_nvidia"]
_dawn_instance_ready = False


class DeviceError(RuntimeError):
    """A GPU request that cannot work on this adapter (limits, missing backend, bad kernel)."""


@dataclass(frozen=True)
class BufferView:
    """A byte range of a buffer, for binding part of it."""

    buffer: Any  # GPUBuffer
    offset: int = 0
    size: int | None = None  # None: to the end of the buffer

    @property
    def nbytes(self) -> int:
        return (self.buffer.size - self.offset) if self.size is None else self.size


Binding = Any  # GPUBuffer | BufferView | bytes | np.ndarray


def grid_1d(n_workgroups: int) -> tuple[int, int, int]:
    """Split a 1-D workgroup count over x and y so no dimension exceeds 65535. The kernel computes
    `wg = workgroup_id.x + workgroup_id.y * num_workgroups.x` and must skip wg >= n_workgroups."""
    if n_workgroups <= MAX_WORKGROUPS_PER_DIM:
        return (max(n_workgroups, 1), 1, 1)
    y = -(-n_workgroups // MAX_WORKGROUPS_PER_DIM)
    x = -(-n_workgroups // y)
    return (x, y, 1)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Recorder:
    """One command encoder with (at most) one open compute pass; dispatches go into the open pass."""

    def __init__(self, device: Any) -> None:
        self._device = device
        self.reset()

    def reset(self) -> None:
        """Start a fresh encoder (after the previous one was finished and submitted)."""
        self.encoder = self._device.create_command_encoder()
        self._pass: Any = None
        self.dispatches = 0

    def compute_pass(self) -> Any:
        if self._pass is None:
            self._pass = self.encoder.begin_compute_pass()
        return self._pass

    def end_pass(self) -> None:
        if self._pass is not None:
            self._pass.end()
            self._pass = None

    def finish(self) -> Any:
        self.end_pass()
        return self.encoder.finish()


class Tape:
    """The commands a step recorded (dispatches with their pipelines and bind groups, copies, clears), replayable
    into a later step with Device.replay at a fraction of the recording cost (no argument checks, uniform packing
    or bind-group lookups): for a step whose commands depend only on shapes and flags, not on data. A write of
    host data inside the step, or a read back, makes the tape not replayable (the host's part would not run)."""

    def __init__(self) -> None:
        self.commands: list[tuple] = []
        self.replayable = True


_DISPATCH, _COPY, _CLEAR = "dispatch", "copy", "clear"


class Device:
    """The process's GPU: adapter choice, limits, buffers, pipeline/bind-group/uniform caches, recording."""

    def __init__(self, backend: str | None = None, *, allow_cpu: bool = True) -> None:
        choice = (backend or os.environ.get("DISTILLERY_BACKEND") or "auto").lower()
        if choice not in ("auto", "wgpu", "dawn"):
            raise DeviceError(f"backend {choice!r} (argument or DISTILLERY_BACKEND): expected auto, wgpu or dawn")
        self.wgpu, self.adapter, self.backend = self._pick_adapter(choice)
        info = self.adapter.info
        self.adapter_type = str(info.get("adapter_type", ""))
        self.is_cpu = self.adapter_type.lower() == "cpu" or "llvmpipe" in str(info.get("device", "")).lower()
        if self.is_cpu:
            if not allow_cpu:
                raise DeviceError(f"only a CPU adapter ({self.adapter.summary}) is available")
            msg = f"GPU: no discrete GPU; using the CPU adapter {self.adapter.summary} (expect ~10 GFLOP/s)"
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        adapter_limits = dict(self.adapter.limits)
        wanted = {k: adapter_limits[k] for k in _MAX_LIMITS if k in adapter_limits}
        feats = [f for f in _WANTED_FEATURES if f in self.adapter.features]
        if self.backend == "dawn":
            from wgpudawn.backends.dawn import extras

            self.device = extras.request_device_sync(
                self.adapter,
                required_features=feats,
                required_limits=wanted,
                label="distillery",
                disable_toggles=["timestamp_quantization"],  # gpu/profile.py times single dispatches
            )
        else:
            self.device = self.adapter.request_device_sync(
                required_features=feats, required_limits=wanted, label="distillery"
            )
        self.queue = self.device.queue
        self.limits: dict[str, int] = dict(self.device.limits)
        self.features: set[str] = set(self.device.features)
        self.max_binding = int(self.limits["max-storage-buffer-binding-size"])
        self.max_buffer = int(self.limits["max-buffer-size"])
        self.offset_alignment = int(self.limits.get("min-storage-buffer-offset-alignment", 256))
        self.usage = self.wgpu.BufferUsage.STORAGE | self.wgpu.BufferUsage.COPY_SRC | self.wgpu.BufferUsage.COPY_DST
        self._pipelines: dict[Any, Any] = {}
        self._sources: dict[Any, str] = {}
        self._uniforms: dict[bytes, Any] = {}
        self._bind_groups: dict[tuple, Any] = {}
        self._bg_keys_by_buffer: dict[int, set[tuple]] = {}
        self._rec: Recorder | None = None
        self._tape: Tape | None = None
        self._max_grid = int(self.limits.get("max-compute-workgroups-per-dimension", MAX_WORKGROUPS_PER_DIM))
        self.profiler: Any = None  # a gpu.profile.Profiler while one is attached: every dispatch timed
        # dispatches per submit inside a step (0: one submit per step, as on a CPU adapter, where the "GPU" is
        # the same cores that record and an early submit only slowed a lavapipe step down, 2.4 -> 3.0 s)
        self.submit_every = 0 if self.is_cpu else SUBMIT_EVERY
        self.live_bytes = 0  # bytes of the buffers this Device created that are still alive
        self.peak_bytes = 0  # the most live_bytes ever reached (the GPU memory our tensors needed)
        self.live_by_label: Counter[str] = Counter()  # live bytes by label, digits folded ("blk.#.ffn_up")
        self.peak_by_label: dict[str, int] = {}  # live_by_label when peak_bytes was reached
        self._fence = self.buffer(4, label="fence")
        self.stats = {"pipelines": 0, "bind_groups": 0, "uniforms": 0, "submits": 0, "dispatches": 0, "write_syncs": 0}
        self.write_sync_bytes = WRITE_SYNC_BYTES
        self._unsynced_write_bytes = 0

    # ---- adapter choice -------------------------------------------------------------------------------
    @staticmethod
    def _pick_adapter(choice: str) -> tuple[ModuleType, Any, str]:
        """Dawn when asked, or in auto mode when wgpu-native sees a real GPU and Dawn offers subgroup
        matrices on it; else the best wgpu-native adapter (discrete > integrated > virtual > CPU)."""
        native = None
        if choice != "dawn":
            import wgpu

            native = _best_adapter(wgpu.gpu.enumerate_adapters_sync(), "wgpu")
            if choice == "wgpu" or (native is not None and _adapter_rank(native)[0] >= 4):
                if native is None:
                    raise DeviceError("no wgpu adapter found (for a CPU run install mesa-vulkan-drivers: lavapipe)")
                return wgpu, native, "wgpu"  # a CPU adapter: Dawn has nothing better to offer
        adapter, module, why = _dawn_adapter()
        if adapter is not None and (choice == "dawn" or SUBGROUP_MATRIX in adapter.features):
            return module, adapter, "dawn"
        if choice == "dawn":
            raise DeviceError(f"backend 'dawn' requested but unavailable: {why}")
        if native is None:
            raise DeviceError("no wgpu adapter found (for a CPU run install mesa-vulkan-drivers: lavapipe)")
        import wgpu

        return wgpu, native, "wgpu"

    @property
    def subgroup_matrix(self) -> bool:
        """Whether tensor cores are reachable (Dawn's subgroup-matrix feature was granted)."""
        return SUBGROUP_MATRIX in self.features

    def memory_bytes(self) -> int | None:
        """The GPU's own memory, its largest device-local heap, where the backend reports it (Dawn with the
        adapter-properties-memory-heaps feature); None elsewhere (wgpu-native, a CPU adapter)."""
        if self.backend != "dawn" or self.is_cpu or "adapter-properties-memory-heaps" not in self.adapter.features:
            return None
        if not hasattr(self, "_memory_bytes"):
            from wgpudawn.backends.dawn import extras

            try:
                heaps = extras.get_adapter_properties(self.adapter).get("memory_heaps", [])
            except (RuntimeError, ValueError, AttributeError) as exc:  # a driver that lists the feature and fails it
                warnings.warn(f"GPU memory heaps not readable ({exc}): no memory-for-speed choice", stacklevel=2)
                heaps = []
            sizes = [int(h["size"]) for h in heaps if "device-local" in h["properties"]]
            self._memory_bytes = max(sizes) if sizes else None
        return self._memory_bytes

    # ---- description ----------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Backend, adapter, limits and features (for `distillery doctor` and run logs)."""
        info = {k: v for k, v in dict(self.adapter.info).items() if isinstance(v, str | int | float)}
        return {
            "backend": "dawn" if self.backend == "dawn" else "wgpu-native",
            "adapter": self.adapter.summary,
            "adapter_info": info,
            "is_cpu": self.is_cpu,
            "subgroup_matrix": SUBGROUP_MATRIX in self.features,
            "memory_bytes": self.memory_bytes(),
            "limits": {k: int(self.limits[k]) for k in _MAX_LIMITS if k in self.limits},
            "features": sorted(self.features),
        }

    # ---- buffers --------------------------------------------------------------------------------------
    def check_binding(self, nbytes: int, what: str = "buffer") -> None:
        """Raise DeviceError when nbytes cannot be bound as one storage binding on this adapter."""
        if nbytes > self.max_binding:
            raise DeviceError(
                f"{what}: {nbytes} bytes ({_mib(nbytes)}) exceeds this adapter's max storage binding of "
                f"{self.max_binding} bytes ({_mib(self.max_binding)}); split the tensor or use a larger GPU"
            )

    def buffer(self, size: int | np.ndarray, usage: int | None = None, label: str = "", *, sliced: bool = False):
        """A zero-filled GPU buffer of `size` bytes (rounded up to 4), or an upload of an array.
        Storage buffers must fit one binding unless sliced=True (then bind BufferViews of it)."""
        if isinstance(size, np.ndarray):
            return self.upload(size, label=label, usage=usage)
        nbytes = max(4, -(-int(size) // 4) * 4)
        usage = self.usage if usage is None else usage
        name = f"buffer {label!r}" if label else "buffer"
        if nbytes > self.max_buffer:
            raise DeviceError(
                f"{name}: {nbytes} bytes ({_mib(nbytes)}) exceeds this adapter's max buffer size of "
                f"{self.max_buffer} bytes ({_mib(self.max_buffer)})"
            )
        if usage & self.wgpu.BufferUsage.STORAGE and not sliced:
            self.check_binding(nbytes, name)
        buf = self.device.create_buffer(size=nbytes, usage=usage, label=label)
        group = _label_group(label)
        self.live_bytes += nbytes
        self.live_by_label[group] += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_by_label = dict(self.live_by_label)
        weakref.finalize(buf, _release_bytes, weakref.ref(self), nbytes, group)
        return buf

    def upload(self, array: np.ndarray | bytes, label: str = "", usage: int | None = None, *, sliced: bool = False):
        """A new buffer holding the bytes of `array` (C order; zero-padded to a multiple of 4 bytes)."""
        data = memoryview(np.ascontiguousarray(array) if isinstance(array, np.ndarray) else array).cast("B")
        buf = self.buffer(len(data), usage=usage, label=label, sliced=sliced)
        if len(data):
            self.write(buf, data)
        return buf

    def write(self, buffer: Any, data: np.ndarray | bytes | memoryview, offset: int = 0) -> None:
        """Write bytes into a buffer, ordered after everything recorded so far (inside a step it becomes a
        copy inside the step's encoder, so the step still submits once)."""
        raw = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data).cast("B")
        n = len(raw)
        if n % 4:
            raw = memoryview(bytes(raw) + b"\0" * (4 - n % 4))
        if offset % 4 or offset + len(raw) > buffer.size:
            raise DeviceError(f"write of {n} bytes at offset {offset} into {buffer.size}-byte buffer {buffer.label!r}")
        if self._rec is None:
            self.queue.write_buffer(buffer, offset, raw)
            self._unsynced_write_bytes += len(raw)
            if self._unsynced_write_bytes >= self.write_sync_bytes:
                self.stats["write_syncs"] += 1
                self.sync()  # the staging of the writes so far can go
            return
        if self._tape is not None:
            self._tape.replayable = False
        staging = self.device.create_buffer_with_data(data=raw, usage=self.wgpu.BufferUsage.COPY_SRC)
        self._rec.end_pass()
        self._rec.encoder.copy_buffer_to_buffer(staging, 0, buffer, offset, len(raw))

    def clear(self, buffer: Any, offset: int = 0, size: int | None = None) -> None:
        """Zero a buffer (range), ordered like a dispatch."""
        if self._tape is not None:
            self._tape.commands.append((_CLEAR, buffer, offset, size))
        with self.step() as rec:
            rec.end_pass()
            rec.encoder.clear_buffer(buffer, offset, size)

    def copy(self, src: Any, dst: Any, nbytes: int, src_offset: int = 0, dst_offset: int = 0) -> None:
        """Copy bytes between buffers, ordered like a dispatch."""
        if self._tape is not None:
            self._tape.commands.append((_COPY, src, dst, nbytes, src_offset, dst_offset))
        with self.step() as rec:
            rec.end_pass()
            rec.encoder.copy_buffer_to_buffer(src, src_offset, dst, dst_offset, nbytes)

    def read(self, buffer: Any, dtype: Any = np.float32, shape: Sequence[int] | int | None = None, offset: int = 0):
        """Submit pending work, wait, and return the buffer's contents as a new ndarray."""
        if self._tape is not None:  # host logic between the tape's commands: they cannot replay without it
            self._tape.replayable = False
        dtype = np.dtype(dtype)
        count = int(np.prod(shape)) if shape is not None else (buffer.size - offset) // dtype.itemsize
        nbytes = count * dtype.itemsize
        self.flush()
        self._unsynced_write_bytes = 0  # the read below submits and waits: the writes before it are done
        raw = self.queue.read_buffer(buffer, offset, -(-nbytes // 4) * 4) if nbytes else b""
        out = np.frombuffer(raw, dtype=np.uint8)[:nbytes].view(dtype).copy()
        return out.reshape(shape if shape is not None else (count,))

    def sync(self) -> None:
        """Submit pending work and wait until the GPU has finished it (wgpu-py 0.32 cannot wait on the
        queue directly, so this reads 4 bytes back)."""
        self.read(self._fence, np.uint32, (1,))

    # ---- pipelines, uniforms, bind groups -------------------------------------------------------------
    def pipeline(self, key: Any, source_fn: Callable[[], str], entry_point: str = "main") -> Any:
        """The compute pipeline for `key` (e.g. ("matmul", variant)); `source_fn()` gives its WGSL and is only
        called the first time."""
        pipe = self._pipelines.get(key)
        if pipe is not None:
            return pipe
        src = source_fn()
        try:
            module = self.device.create_shader_module(code=src, label=str(key)[:200])
            pipe = self.device.create_compute_pipeline(
                layout="auto", compute={"module": module, "entry_point": entry_point}, label=str(key)[:200]
            )
        except Exception as e:
            raise DeviceError(f"kernel {key}: compilation failed: {e}") from e
        self._pipelines[key] = pipe
        self._sources[key] = src
        self.stats["pipelines"] += 1
        return pipe

    def source(self, key: Any) -> str:
        """The WGSL a cached pipeline was built from (for debugging)."""
        return self._sources[key]

    def uniform(self, data: bytes | np.ndarray) -> Any:
        """An immutable uniform buffer holding `data`, cached by content."""
        raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
        if len(raw) % 16:
            raw += b"\0" * (-len(raw) % 16)
        buf = self._uniforms.get(raw)
        if buf is None:
            buf = self.device.create_buffer_with_data(data=raw, usage=self.wgpu.BufferUsage.UNIFORM)
            self._uniforms[raw] = buf
            self.stats["uniforms"] += 1
        return buf

    def bind_group(self, pipeline: Any, bindings: Sequence[Binding]) -> Any:
        """The bind group (group 0) of `pipeline` over `bindings` (binding i = bindings[i]), cached by the
        buffers' unique ids and ranges; an entry is dropped when one of its buffers is garbage collected.
        A cached group costs one key lookup (a training step binds ~4,000 times)."""
        views = []
        for b in bindings:
            if isinstance(b, bytes | bytearray | np.ndarray):
                b = self.uniform(b)
            views.append(b if isinstance(b, BufferView) else BufferView(b))
        key = (pipeline.uid, tuple((v.buffer.uid, v.offset, v.size) for v in views))
        bg = self._bind_groups.get(key)
        if bg is None:
            bg = self._create_bind_group(key, pipeline, views)
        return bg

    def _create_bind_group(self, key: tuple, pipeline: Any, views: list[BufferView]) -> Any:
        entries = []
        for i, view in enumerate(views):
            if view.offset % self.offset_alignment:
                raise DeviceError(
                    f"binding {i} ({view.buffer.label!r}): offset {view.offset} is not a multiple of "
                    f"{self.offset_alignment} (min-storage-buffer-offset-alignment)"
                )
            if view.offset + view.nbytes > view.buffer.size:
                raise DeviceError(
                    f"binding {i} ({view.buffer.label!r}): range {view.offset}+{view.nbytes} exceeds the "
                    f"buffer's {view.buffer.size} bytes"
                )
            if view.buffer.usage & self.wgpu.BufferUsage.STORAGE:
                self.check_binding(view.nbytes, f"binding {i} ({view.buffer.label!r})")
            entries.append(
                {
                    "binding": i,
                    "resource": {"buffer": view.buffer, "offset": view.offset, "size": view.nbytes},
                }
            )
        try:
            bg = self.device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=entries)
        except Exception as e:
            raise DeviceError(f"bind group for pipeline {pipeline.label!r}: {e}") from e
        self._bind_groups[key] = bg
        self.stats["bind_groups"] += 1
        for view in views:
            uid = view.buffer.uid
            if uid not in self._bg_keys_by_buffer:
                self._bg_keys_by_buffer[uid] = set()
                weakref.finalize(view.buffer, _forget_buffer, weakref.ref(self), uid)
            self._bg_keys_by_buffer[uid].add(key)
        return bg

    def _forget(self, uid: int) -> None:
        for key in self._bg_keys_by_buffer.pop(uid, ()):
            self._bind_groups.pop(key, None)

    # ---- recording and submission ---------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self) -> Iterator[Recorder]:
        """Record every dispatch/copy/write inside the block into command encoders and submit them in order:
        every `submit_every` dispatches and at the end (nested steps join the outer one). On an exception
        what was recorded since the last submit is dropped (earlier chunks have run)."""
        if self._rec is not None:
            yield self._rec
            return
        self._rec = Recorder(self.device)
        try:
            yield self._rec
        except BaseException:
            self._rec = None
            raise
        rec, self._rec = self._rec, None
        self._submit(rec)

    def _submit(self, rec: Recorder) -> None:
        if self.profiler is not None:
            rec.end_pass()
            self.profiler.resolve(rec.encoder)
        self.queue.submit([rec.finish()])
        self.stats["submits"] += 1
        if self.profiler is not None:
            self.profiler.collect()

    def flush(self) -> None:
        """Submit what the current step recorded so far and keep recording into a fresh encoder."""
        if self._rec is not None:
            self._submit(self._rec)
            self._rec.reset()

    def dispatch(
        self,
        pipeline: Any,
        bindings: Sequence[Binding],
        grid: int | tuple[int, ...],
        label: str | None = None,
    ) -> None:
        """Record one dispatch of `pipeline` over `grid` workgroups (int or (x, y[, z]), each <= 65535; see
        grid_1d) into the current step, or submit it at once outside a step."""
        g = (grid, 1, 1) if isinstance(grid, int) else tuple(grid) + (1,) * (3 - len(grid))
        if any(d > self._max_grid for d in g):
            raise DeviceError(
                f"dispatch of {pipeline.label!r}: grid {g} exceeds {self._max_grid} workgroups per dimension "
                "(split it with grid_1d)"
            )
        if min(g) <= 0:
            return
        bg = self.bind_group(pipeline, bindings)
        if self._tape is not None:
            self._tape.commands.append((_DISPATCH, pipeline, bg, g))
        with self.step() as rec:
            self._record_dispatch(rec, pipeline, bg, g)

    def _record_dispatch(self, rec: Recorder, pipeline: Any, bg: Any, g: tuple[int, ...]) -> None:
        """One dispatch into rec (the current step's recorder); submits every submit_every of them."""
        if self.profiler is not None:  # its own pass, timestamped (gpu/profile.py)
            rec.end_pass()
            cp = rec.encoder.begin_compute_pass(timestamp_writes=self.profiler.timestamp_writes(pipeline.label, g))
        else:
            cp = rec.compute_pass()
        cp.set_pipeline(pipeline)
        cp.set_bind_group(0, bg)
        cp.dispatch_workgroups(*g)
        if self.profiler is not None:
            cp.end()
        rec.dispatches += 1
        self.stats["dispatches"] += 1
        if self.submit_every and rec.dispatches >= self.submit_every:
            self.flush()

    # ---- tapes: record a step once, replay it ---------------------------------------------------------
    @contextlib.contextmanager
    def taping(self) -> Iterator[Tape]:
        """Record (and run) the block's commands as usual and also into the yielded Tape."""
        if self._tape is not None:
            raise DeviceError("taping: a tape is already being recorded")
        self._tape = tape = Tape()
        try:
            yield tape
        finally:
            self._tape = None

    def replay(self, tape: Tape) -> None:
        """Record a tape's commands again, in order, into the current step (or one of their own)."""
        if not tape.replayable:
            raise DeviceError("replay: the tape wrote host data inside its step and cannot be replayed")
        with self.step() as rec:
            for cmd in tape.commands:
                kind = cmd[0]
                if kind is _DISPATCH:
                    self._record_dispatch(rec, cmd[1], cmd[2], cmd[3])
                    continue
                rec.end_pass()
                if kind is _COPY:
                    _, src, dst, nbytes, src_offset, dst_offset = cmd
                    rec.encoder.copy_buffer_to_buffer(src, src_offset, dst, dst_offset, nbytes)
                else:
                    rec.encoder.clear_buffer(cmd[1], cmd[2], cmd[3])


GPU_INDEX_ENV = "DISTILLERY_GPU_INDEX"


def gpu_index() -> int | None:
    """The adapter index asked for by DISTILLERY_GPU_INDEX (a Ray worker sets it from its assigned GPU), or None."""
    raw = os.environ.get(GPU_INDEX_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise DeviceError(f"{GPU_INDEX_ENV}={raw!r}: expected a GPU index (0, 1, ...)")
    return int(raw)


def _best_adapter(adapters: list[Any], backend: str) -> Any:
    """The preferred adapter (_adapter_rank); with DISTILLERY_GPU_INDEX=i, the i-th of the best kind in the
    driver's enumeration order (on NVIDIA the order of nvidia-smi and of Ray's GPU ids), since wgpu does not
    read CUDA_VISIBLE_DEVICES."""
    if not adapters:
        return None
    best = min(adapters, key=_adapter_rank)
    index = gpu_index()
    if index is None:
        return best
    peers = [a for a in adapters if _adapter_rank(a) == _adapter_rank(best)]
    if index >= len(peers):
        names = ", ".join(str(a.summary) for a in peers)
        raise DeviceError(f"{GPU_INDEX_ENV}={index}: {backend} lists {len(peers)} adapter(s) of the best kind: {names}")
    return peers[index]


def _adapter_rank(a: Any) -> tuple[int, int]:
    """Sort key: discrete < integrated < virtual < other < CPU; native APIs before OpenGL."""
    kind = {"discretegpu": 0, "integratedgpu": 1, "virtualgpu": 2, "cpu": 4}
    t = str(a.info.get("adapter_type", "")).lower().replace(" ", "").replace("_", "")
    api = str(a.info.get("backend_type", "")).lower()
    return (kind.get(t, 3), 1 if api in ("opengl", "gl", "gles") else 0)


def _label_group(label: str) -> str:
    """A buffer label with its numbers folded, so the layers' buffers add up under one name."""
    return re.sub(r"\d+", "#", label) or "(unlabelled)"


def _release_bytes(dev_ref: weakref.ref, nbytes: int, group: str) -> None:
    dev = dev_ref()
    if dev is not None:
        dev.live_bytes -= nbytes
        dev.live_by_label[group] -= nbytes


def _forget_buffer(dev_ref: weakref.ref, uid: int) -> None:
    dev = dev_ref()
    if dev is not None:
        dev._forget(uid)


def _dawn_adapter() -> tuple[Any, ModuleType | None, str]:
    """(adapter, wgpudawn module, reason) — adapter None when Dawn is missing or sees no adapter."""
    global _dawn_instance_ready
    try:
        import wgpudawn
        from wgpudawn.backends.dawn import extras
    except ImportError as e:
        return None, None, f"wgpudawn is not installed ({e})"
    try:
        if not _dawn_instance_ready:
            extras.set_instance_extras(backends=["Vulkan"], enable_toggles=_DAWN_TOGGLES)
            _dawn_instance_ready = True
        if gpu_index() is not None:
            return _best_adapter(wgpudawn.gpu.enumerate_adapters_sync(), "dawn"), wgpudawn, ""
        return wgpudawn.gpu.request_adapter_sync(power_preference="high-performance"), wgpudawn, ""
    except Exception as e:  # Dawn raises RuntimeError when it finds no adapter (e.g. lavapipe)
        _dawn_instance_ready = True
        return None, wgpudawn, f"Dawn found no adapter ({e})"
