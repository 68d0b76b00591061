"""The WebGPU device: one adapter per process, buffers, pipelines cached per specialization.

`wgpu` (wgpu-py) picks the adapter: a real GPU where there is one (Vulkan,
Metal or D3D12), Mesa's lavapipe (a CPU Vulkan driver) on machines without.
Everything here is lazy: importing this module never touches a driver.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
from dataclasses import dataclass

import numpy as np
import torch

TEMPLATES = pathlib.Path(__file__).resolve().parent

# Input dtypes as the shaders see them (16-bit inputs are packed pairs in u32 words).
SHADER_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Gpu:
    """The device and what it allows."""

    device: object          # wgpu.GPUDevice
    adapter: str            # the adapter's summary, e.g. "llvmpipe (LLVM 15.0.6) (CPU) via Vulkan"
    max_storage_buffers: int
    max_binding_bytes: int
    max_workgroup_bytes: int
    max_workgroups: int


@functools.cache
def _acquire() -> Gpu | str:
    """The process's Gpu, or the reason there is none (cached either way)."""
    try:
        import jinja2  # noqa: F401  (the templates need it too)
        import wgpu
    except ImportError as e:
        return f"{e.name} is not installed: pip install 'deltarule[wgsl]'"
    if importlib.util.find_spec("triton") is not None:
        # Mesa's lavapipe and Triton each carry their own LLVM: loading libtriton
        # after a lavapipe adapter exists crashes the process, the other order works.
        import triton  # noqa: F401
    try:
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    except Exception as e:                      # no driver / no ICD: wgpu raises its own errors
        return f"no WebGPU adapter ({type(e).__name__}: {e})"
    if adapter is None:
        return "no WebGPU adapter (install a GPU driver, or Mesa's lavapipe: mesa-vulkan-drivers libvulkan1)"
    lim = adapter.limits
    wanted = {                                   # ask for what the adapter offers, not the defaults
        "max-storage-buffers-per-shader-stage": lim["max-storage-buffers-per-shader-stage"],
        "max-storage-buffer-binding-size": lim["max-storage-buffer-binding-size"],
        "max-buffer-size": lim["max-buffer-size"],
        "max-compute-workgroup-storage-size": lim["max-compute-workgroup-storage-size"],
    }
    device = adapter.request_device_sync(required_limits=wanted)
    return Gpu(
        device=device,
        adapter=adapter.summary,
        max_storage_buffers=wanted["max-storage-buffers-per-shader-stage"],
        max_binding_bytes=min(wanted["max-storage-buffer-binding-size"], wanted["max-buffer-size"]),
        max_workgroup_bytes=wanted["max-compute-workgroup-storage-size"],
        max_workgroups=lim["max-compute-workgroups-per-dimension"],
    )


def unavailable_reason() -> str | None:
    """None when a WebGPU device is usable here, else why not."""
    got = _acquire()
    return got if isinstance(got, str) else None


def gpu() -> Gpu:
    got = _acquire()
    if isinstance(got, str):
        raise RuntimeError(got)
    return got


@functools.cache
def _environment():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )


def render(template: str, spec: tuple) -> str:
    """WGSL source of `template` specialized by `spec` ((name, value) pairs)."""
    return _environment().get_template(template).render(**dict(spec))


@functools.lru_cache(maxsize=256)
def pipeline(template: str, spec: tuple):
    """The compute pipeline of one specialization, compiled once per process."""
    device = gpu().device
    module = device.create_shader_module(code=render(template, spec))
    return device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})


def _usage():
    import wgpu

    return wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST


def _padded(raw: bytes) -> bytes:
    """WebGPU binds whole 4-byte words and no empty buffers."""
    return raw + b"\0" * (-len(raw) % 4) if raw else b"\0" * 4


def tensor_bytes(x: torch.Tensor) -> bytes:
    """The tensor's elements in C order as the shaders read them (16-bit types as raw bits)."""
    x = x.detach().to("cpu").contiguous()
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.view(torch.int16)
    return x.numpy().tobytes()


def upload(data: torch.Tensor | np.ndarray | bytes):
    """A new storage buffer holding `data` (a tensor, a NumPy array or raw bytes)."""
    if isinstance(data, torch.Tensor):
        data = tensor_bytes(data)
    elif isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).tobytes()
    return gpu().device.create_buffer_with_data(data=_padded(data), usage=_usage())


def zeros(nbytes: int):
    """A new zero-filled storage buffer (WebGPU zero-initializes every buffer)."""
    return gpu().device.create_buffer(size=max(4, nbytes + (-nbytes % 4)), usage=_usage())


def uniform(raw: bytes):
    import wgpu

    raw = raw + b"\0" * (-len(raw) % 16)
    return gpu().device.create_buffer_with_data(data=raw, usage=wgpu.BufferUsage.UNIFORM)


def download(buffer, nbytes: int) -> bytes:
    """The first `nbytes` of a storage buffer, copied to the host (waits for the queue)."""
    if nbytes == 0:
        return b""
    return bytes(gpu().device.queue.read_buffer(buffer, 0, nbytes + (-nbytes % 4)))[:nbytes]


def write(buffer, data: torch.Tensor) -> None:
    gpu().device.queue.write_buffer(buffer, 0, _padded(tensor_bytes(data)))


def dispatch(template: str, spec: tuple, buffers: dict[int, object], grid: tuple[int, int, int]) -> None:
    """Bind `buffers` (binding -> buffer) to the specialization's pipeline and run `grid` workgroups."""
    device = gpu().device
    pipe = pipeline(template, spec)
    entries = []
    for binding, buf in sorted(buffers.items()):
        entries.append({"binding": binding, "resource": {"buffer": buf, "offset": 0, "size": buf.size}})
    group = device.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=entries)
    encoder = device.create_command_encoder()
    compute = encoder.begin_compute_pass()
    compute.set_pipeline(pipe)
    compute.set_bind_group(0, group)
    compute.dispatch_workgroups(*grid)
    compute.end()
    device.queue.submit([encoder.finish()])
