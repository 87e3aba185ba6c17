"""Builds dspark_rt._C with CMake. Knobs (environment): DSPARK_CUDA=auto|0|1,
DSPARK_CUDA_ARCHS (default "80;90a"), DSPARK_BUILD_JOBS, DSPARK_PTXAS_VERBOSE=1."""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        cuda = os.environ.get("DSPARK_CUDA", "auto")
        if cuda not in ("auto", "0", "1"):
            raise SystemExit(f"DSPARK_CUDA must be auto, 0 or 1, got {cuda!r}")
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DDSPARK_CUDA={cuda}",
            f"-DDSPARK_CUDA_ARCHS={os.environ.get('DSPARK_CUDA_ARCHS', '80;90a')}",
            f"-DDSPARK_PTXAS_VERBOSE={os.environ.get('DSPARK_PTXAS_VERBOSE', '0')}",
            f"-DDSPARK_VERSION={self.distribution.get_version()}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        try:
            import ninja  # noqa: F401
            args.append("-GNinja")
        except ImportError:
            pass
        jobs = os.environ.get("DSPARK_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.run(["cmake", str(ROOT), *args], cwd=build_dir, check=True)
        subprocess.run(["cmake", "--build", ".", "--parallel", jobs], cwd=build_dir, check=True)


setup(ext_modules=[CMakeExtension("dspark_rt._C")], cmdclass={"build_ext": CMakeBuild})
