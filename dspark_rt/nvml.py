"""The GPUs as NVML reports them (identity, clocks, power limit): for throughput profiles, whose
validity depends on them, and for `dspark-rt env`."""


def nvml_state() -> list[dict]:
    """Per-GPU identity and clocks from NVML, or [] when NVML is absent."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver on this machine
        return []
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            out.append({
                "index": i,
                "name": name.decode() if isinstance(name, bytes) else name,
                "uuid": pynvml.nvmlDeviceGetUUID(h),
                "driver": pynvml.nvmlSystemGetDriverVersion(),
                "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
                "mem_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
                "power_limit_w": pynvml.nvmlDeviceGetPowerManagementLimit(h) / 1000.0,
                "memory_total_gib": pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30,
            })
    finally:
        pynvml.nvmlShutdown()
    return out
