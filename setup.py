"""Builds tokamax_torch/_C.so through the project's CMakeLists.txt against the installed torch."""

import os
import pathlib
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        output = pathlib.Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = ROOT / "build" / "torch"
        generator = ["-G", "Ninja"] if _has_ninja() else []
        subprocess.check_call(
            ["cmake", "-S", str(ROOT), "-B", str(build_dir), *generator,
             "-DCMAKE_BUILD_TYPE=Release", "-DTOKAMAX_BUILD_TORCH=ON",
             f"-DPython3_EXECUTABLE={sys.executable}", f"-DTOKAMAX_OUTPUT_DIR={output}"]
        )
        subprocess.check_call(["cmake", "--build", str(build_dir), "--parallel", str(os.cpu_count() or 2)])

    def get_ext_filename(self, fullname: str) -> str:
        # Loaded with torch.ops.load_library, not imported: no Python ABI tag in the name.
        return os.path.join(*fullname.split(".")) + ".so"


def _has_ninja() -> bool:
    from shutil import which

    return which("ninja") is not None


setup(ext_modules=[CMakeExtension("tokamax_torch._C")], cmdclass={"build_ext": CMakeBuild})
