"""The Ray cluster of a run (scale.ray_address) and what a Ray task or actor of the run asks it for.

Ray runs the scale-out work: teacher shards as Ray tasks (stages/teacher_ray.py) and data-parallel training
workers as Ray actors (training/data_parallel.py). The driver (the Prefect flow's process) connects once per
process; an already connected process (a test's cluster, a `ray job submit` driver) is used as it is.

Addresses: auto -> ray.init(address=None): RAY_ADDRESS, else the newest cluster started on this machine, else a
new local one; local -> always a new local one; anything else (ray://head:10001, head:6379) is passed to Ray.
Every node must see the run's workdir and GGUF files at the same absolute paths (a shared filesystem) and have
distillery installed; the driver hands tasks absolute paths (`absolute_config`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from schemas.config import RunConfig

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The Ray cluster of scale.ray_address cannot run what the config asks (unreachable, no GPU, ...)."""


def connect(cfg: RunConfig) -> Any:
    """The ray module, connected to the cluster of cfg.scale.ray_address (once per process)."""
    import ray

    if ray.is_initialized():
        return ray
    address = cfg.scale.ray_address
    try:
        ray.init(address=None if address == "auto" else address, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterError(f"scale.ray_address: {address}: cannot connect to Ray ({exc})") from None
    resources = ray.cluster_resources()
    log.info(
        "ray: connected to %s: %d CPUs, %d GPUs on %d nodes",
        address,
        int(resources.get("CPU", 0)),
        int(resources.get("GPU", 0)),
        len([n for n in ray.nodes() if n.get("Alive")]),
    )
    return ray


def cluster_gpus() -> int:
    """GPUs in the connected cluster."""
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def resources(backend: str, field: str, gpus_per_worker: float = 1.0) -> dict[str, Any]:
    """Ray resource options of one teacher task or training worker whose engine setting `field` is `backend`
    (auto | gpu | numpy): gpus_per_worker GPUs (scale.gpus_per_worker) where the cluster has GPUs and the backend
    may use one, else one CPU (a gpu backend then takes whatever wgpu adapter its node has, e.g. lavapipe; Ray
    counts CUDA GPUs only). A worker opens its assigned GPU through pin_assigned_gpu."""
    gpus = cluster_gpus()
    if backend != "numpy" and gpus > 0:
        return {"num_gpus": gpus_per_worker, "num_cpus": 1}
    if backend == "gpu":
        log.warning("%s: gpu, but the Ray cluster lists no GPUs: one CPU per worker, on its node's wgpu adapter", field)
    return {"num_cpus": 1}


def absolute_config(cfg: RunConfig) -> RunConfig:
    """cfg with the workdir and the model and data paths absolute, so a worker with another current directory
    reads the same files (file contents, never paths, enter the cache keys)."""
    data = cfg.model_dump(mode="json")
    for section, name in (("run", "workdir"), ("model", "student"), ("model", "teacher"), ("data", "path")):
        data[section][name] = str(Path(data[section][name]).resolve())
    if data["data"].get("eval_path"):
        data["data"]["eval_path"] = str(Path(data["data"]["eval_path"]).resolve())
    return RunConfig.model_validate(data)


def pin_assigned_gpu() -> None:
    """Inside a Ray worker that was given GPUs: make gpu/device.py open the first of them (wgpu does not read the
    CUDA_VISIBLE_DEVICES Ray sets), by DISTILLERY_GPU_INDEX; a worker without GPUs is left as it is."""
    import os

    import ray

    from gpu.device import GPU_INDEX_ENV

    ids = ray.get_gpu_ids()
    if ids:
        os.environ[GPU_INDEX_ENV] = str(int(ids[0]))
