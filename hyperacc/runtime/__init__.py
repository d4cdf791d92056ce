"""Layer 2: the process (device, backend, process group), the DeviceMeshes, progress counters, the collective watchdog and per-step housekeeping."""
from hyperacc.runtime.process import (  # noqa: F401 - the package's public names
    BACKENDS,
    DEVICE_ENV,
    Runtime,
    device_module,
    collective_float_dtype,
    detect_device_type,
    detect_launcher,
    die_with_launcher,
    init_runtime,
    shutdown,
)
