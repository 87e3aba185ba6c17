"""`python -m dspark_rt env`: what this build and this machine offer."""
import platform

from ..nvml import nvml_state


def collect() -> dict:
    import torch

    from .. import __version__, ops
    info = {"dspark_rt": __version__, "python": platform.python_version(),
            "platform": platform.platform(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "backends": ops.available_backends()}
    if ops._C is not None:
        info["extension"] = dict(ops._C.build_info())
    else:
        info["extension"] = None
    info["gpus"] = nvml_state()
    return info


def main(as_json: bool = False):
    import json
    info = collect()
    if as_json:
        print(json.dumps(info, indent=2))
        return
    ext = info["extension"]
    print(f"dspark_rt {info['dspark_rt']}  python {info['python']}  torch {info['torch']}")
    print(f"platform: {info['platform']}")
    if ext is None:
        print("extension dspark_rt._C: NOT BUILT (ops fall back to the PyTorch reference)")
    else:
        cuda = f"yes (archs {ext.get('cuda_archs')}, CUDA {ext.get('cuda_version')})" if ext.get("cuda") else "no"
        print(f"extension dspark_rt._C {ext.get('version')}: C++ CPU kernels yes; CUDA kernels {cuda}; "
              f"compiler {ext.get('compiler')}")
    print(f"op backends: {', '.join(info['backends'])}")
    print(f"torch sees CUDA: {info['cuda_available']} (torch CUDA {info['torch_cuda']})")
    if not info["gpus"]:
        print("NVML: no GPU (or nvidia-ml-py not installed)")
    for g in info["gpus"]:
        print(f"GPU {g['index']}: {g['name']} {g['uuid']} driver {g['driver']} SM {g['sm_clock_mhz']}/"
              f"{g['max_sm_clock_mhz']} MHz, mem {g['mem_clock_mhz']} MHz, power limit "
              f"{g['power_limit_w']:.0f} W, {g['memory_total_gib']:.0f} GiB")
