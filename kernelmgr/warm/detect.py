"""Has this process already touched a GPU? Asked in a warm process before it is handed a slice.

CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when it initialises. A warm process that already
initialised CUDA (a framework that creates a context at import) would keep seeing whatever
devices it saw then, whatever slice it is given afterwards: it must never become a kernel.

Two checks, both cheap:

* framework level: ``torch.cuda.is_initialized()`` when ``torch`` is imported (torch creates
  its context lazily, so after ``import torch`` this is normally ``False``);
* driver level: an open file descriptor on a GPU device node (``/dev/nvidia*``, ``/dev/kfd``,
  ``/dev/dri/*``). A CUDA context holds ``/dev/nvidiactl`` and ``/dev/nvidiaN`` open; NVML
  alone does too, which is also refused, as it means the GPU was touched.
"""

from __future__ import annotations

import os
import sys

#: Device nodes whose being open means a GPU driver was opened by this process.
GPU_DEVICE_PREFIXES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/")


def open_gpu_devices(fd_dir: str = "/proc/self/fd") -> list[str]:
    """GPU device nodes this process holds open (empty where ``/proc`` is not available)."""
    found: list[str] = []
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue  # closed since listed
        if target.startswith(GPU_DEVICE_PREFIXES):
            found.append(target)
    return sorted(set(found))


def framework_initialised() -> list[str]:
    """The imported frameworks that report an initialised CUDA runtime."""
    touched: list[str] = []
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    if callable(is_initialized):
        try:
            if is_initialized():
                touched.append("torch (torch.cuda.is_initialized() is True)")
        except Exception as exc:  # a broken framework is not a clean one
            touched.append(f"torch (torch.cuda.is_initialized() raised {type(exc).__name__})")
    return touched


def gpu_touched() -> str | None:
    """Why this process may not take a slice any more, or ``None`` when no GPU was touched."""
    reasons = framework_initialised()
    devices = open_gpu_devices()
    if devices:
        reasons.append("GPU device files open: " + ", ".join(devices))
    return "; ".join(reasons) if reasons else None
