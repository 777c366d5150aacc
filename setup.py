"""The wheel's one build hook: the prebuilt kernels (bloomery/engine/cuda/fatbin.py).

After build_py copies the package, each kernels/*.cu module gets its fatbin in the build tree:
kept where the tree already holds a fresh one (bloomery/engine/cuda/prebuilt/, made by
`python3 -m bloomery.engine.cuda.fatbin`), else built with nvcc where one is found. Without nvcc
the wheel ships without them and the cards compile with NVRTC at start, as before; a failed nvcc
build fails the wheel. BLOOMERY_BUILD_KERNELS=0 skips the step; =1 makes a missing nvcc an error.
"""
import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _fatbin():
    # by path: importing bloomery here would need its dependencies, which a build has not
    spec = importlib.util.spec_from_file_location("_bloomery_fatbin", HERE / "bloomery/engine/cuda/fatbin.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildWithKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return                   # an editable install reads the tree's own prebuilt/ folder
        want = os.environ.get("BLOOMERY_BUILD_KERNELS", "")
        if want == "0":
            self.announce("bloomery: BLOOMERY_BUILD_KERNELS=0, no prebuilt kernels", level=2)
            return
        fb = _fatbin()
        out = Path(self.build_lib) / "bloomery/engine/cuda/prebuilt"
        stale = [m for m in fb.MODULES if not fb.fresh(m, out, kdir=HERE / "kernels")]
        if not stale:
            return
        nvcc = fb.find_nvcc()
        if nvcc is None:
            if want == "1":
                raise SystemExit("bloomery: BLOOMERY_BUILD_KERNELS=1 but nvcc was not found (BLOOMERY_NVCC names it)")
            self.announce(f"bloomery: no nvcc, so no prebuilt kernels for {', '.join(stale)}: "
                          "cards compile them with NVRTC at start", level=2)
            for m in stale:          # never ship a stale pair
                for ext in ("fatbin", "json"):
                    (out / f"{m}.{ext}").unlink(missing_ok=True)
            return
        fb.build(out, nvcc, modules=tuple(stale), kdir=HERE / "kernels", log=lambda s: self.announce(s, level=2))


setup(cmdclass={"build_py": BuildWithKernels})
