"""Build gadei's native core gadei._native (pyproject.toml holds the rest: metadata, packages,
dependencies).

The extension is compiled with OpenMP when the compiler supports it (probed by compiling a
tiny program with -fopenmp); otherwise it is built serial and a warning says so. The update
kernel picks AVX2 or portable code when it loads (the CPU is asked, not the build
machine), so the built package is portable across x86-64 machines. GADEI_NO_OPENMP=1
forces the serial build.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_PROBE = r"""
#include <omp.h>
int main(void) {
    int n = 0;
    #pragma omp parallel reduction(+:n)
    n += 1;
    return n > 0 && omp_get_max_threads() > 0 ? 0 : 1;
}
"""


def _compiler_supports_openmp(compiler_cmd):
    """Compile and link the probe with -fopenmp; True when it builds."""
    workdir = tempfile.mkdtemp(prefix="gadei-omp-probe-")
    try:
        source = os.path.join(workdir, "probe.c")
        with open(source, "w") as handle:
            handle.write(_PROBE)
        result = subprocess.run(
            [*compiler_cmd, "-fopenmp", source, "-o", os.path.join(workdir, "probe")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
        return result.returncode == 0
    except OSError:
        return False
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class BuildExt(build_ext):
    """build_ext that adds OpenMP flags when the compiler has them, and warns when not."""

    def build_extensions(self):
        compiler_cmd = list(getattr(self.compiler, "compiler_so", None) or [sysconfig.get_config_var("CC") or "cc"])
        # compiler_so carries the compile flags; the probe needs only the program name.
        compiler_cmd = compiler_cmd[:1]
        disabled = os.environ.get("GADEI_NO_OPENMP") == "1"
        openmp = not disabled and _compiler_supports_openmp(compiler_cmd)
        if not openmp:
            why = "GADEI_NO_OPENMP=1 is set" if disabled else "the C compiler does not support OpenMP (-fopenmp)"
            sys.stderr.write(
                f"WARNING: gadei: {why}; building the native update kernel serial. It will use one thread.\n"
            )
        for ext in self.extensions:
            if openmp:
                ext.extra_compile_args.append("-fopenmp")
                ext.extra_link_args.append("-fopenmp")
        super().build_extensions()


native = Extension(
    "gadei._native",
    sources=["native/gadei_native.c", "native/kernels.c"],
    depends=["native/kernels.h"],
    extra_compile_args=["-O3", "-ffp-contract=off", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

# The project's metadata, packages and dependencies are in pyproject.toml; setup.py adds the
# native extension, whose OpenMP flags need the probe above.
setup(ext_modules=[native], cmdclass={"build_ext": BuildExt})
