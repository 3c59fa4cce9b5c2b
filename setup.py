"""Builds the Cython extensions in cext/ (the package's metadata is in pyproject.toml).

Compiler directives live here and only here. Build in place with
``python setup.py build_ext --inplace`` (the Makefile does it). Set
``CEXT_MODULES=utf8,chunk`` to build only some modules while developing, and
``CEXT_DEBUG=1`` to turn bounds checks back on (the tests in CI run the fast build).

Hand-written C lives in cext/csrc/ (``cext/*.c`` are Cython's generated files). C_SOURCES
names the sources each module compiles with its ``.pyx``: cext.cpu owns the CPU probe, the
instruction-set switch and the thread pool (csrc/cpu.c), the other kernel modules reach them
through csrc/cpu_client.c. Portable flags only: the kernels compile one variant per
instruction set (target attributes) and pick one per call, so no ``-march=native``.
"""
import os
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
DEBUG = os.environ.get("CEXT_DEBUG") == "1"

DIRECTIVES = {
    "language_level": "3",
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
}


CPU_CLIENT = "cext/csrc/cpu_client.c"  # cpu.h's calls forwarded to cext.cpu (one probe, switch and pool)
C_SOURCES = {"cpu": ["cext/csrc/cpu.c"], "ops": ["cext/csrc/fused_kernels.c", CPU_CLIENT],
             "qgemm": ["cext/csrc/qgemm.c", CPU_CLIENT], "sampler": ["cext/csrc/sampler_kernels.c", CPU_CLIENT]}
C_FLAGS = {"cpu": ["-pthread"], "ops": ["-fopenmp-simd", "-fno-math-errno"], "qgemm": ["-fno-math-errno"],
           "sampler": ["-fno-math-errno", "-fno-trapping-math", "-Wno-psabi"]}
LINK_FLAGS = {"cpu": ["-pthread"], "ops": ["-lm"], "qgemm": ["-lm"]}

def extensions():
    wanted = {m for m in os.environ.get("CEXT_MODULES", "").split(",") if m}
    exts = []
    for pyx in sorted((HERE / "cext").glob("*.pyx")):
        name = pyx.stem
        if wanted and name not in wanted:
            continue
        exts.append(
            Extension(
                f"cext.{name}",
                [str(pyx.relative_to(HERE)), *C_SOURCES.get(name, [])],
                include_dirs=[np.get_include(), str(HERE / "cext")],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                extra_compile_args=(["-O3"] if not DEBUG else ["-O0", "-g"]) + C_FLAGS.get(name, []),
                extra_link_args=LINK_FLAGS.get(name, []),
                depends=[str(p.relative_to(HERE)) for p in (HERE / "cext" / "csrc").glob("*.h")],
            )
        )
    return cythonize(exts, compiler_directives=DIRECTIVES, quiet=True)


# Name, version, dependencies, packages and the console script live in pyproject.toml.
setup(ext_modules=extensions(), zip_safe=False)
