"""What the code tool's sandbox sees of the host: the interpreter, the system libraries and an allow-list of packages."""

from __future__ import annotations

import functools
import glob
import os
import sys
import sysconfig
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

DEFAULT_PACKAGES = ("numpy", "sympy")  # what model-written math code imports; used where installed
SANDBOX_PACKAGES = "/packages"  # where the allowed packages appear inside the sandbox
# The C library, the dynamic loader and the shared libraries the interpreter and the packages load.
_LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32")
_LIBRARY_FILES = ("/etc/ld.so.cache",)


@dataclass(frozen=True)
class SandboxView:
    """The read-only view a sandboxed call gets (every path outside it does not exist there).

    interpreter: the Python binary, at its host path (so it finds its standard library as at home).
    read_only: (host path, sandbox path) bind mounts: the system library directories, the
        interpreter's prefix/lib and standard library, each allowed package under SANDBOX_PACKAGES.
    symlinks: (target, path) links the host has in place of a directory (merged /usr: /lib -> usr/lib).
    hidden: directories inside the bound trees covered by an empty read-only tmpfs (every
        site-packages and dist-packages: only the allow-listed packages are visible).
    packages: the allowed import names; package_dirs: the host directories that hold them (what
        ``isolation: none`` puts on sys.path instead).
    """

    interpreter: str
    read_only: Tuple[Tuple[str, str], ...]
    symlinks: Tuple[Tuple[str, str], ...]
    hidden: Tuple[str, ...]
    packages: Tuple[str, ...]
    package_dirs: Tuple[str, ...]


def installed_default_packages() -> Tuple[str, ...]:
    """The names of DEFAULT_PACKAGES that this environment has."""
    from importlib.metadata import packages_distributions

    providers = packages_distributions()
    return tuple(name for name in DEFAULT_PACKAGES if name in providers)


@functools.lru_cache(maxsize=8)
def sandbox_view(packages: Tuple[str, ...]) -> SandboxView:
    """The view for ``packages`` (import names; each with the distributions it requires). Raises
    ValueError naming a package that is not installed."""
    interpreter = os.path.realpath(sys.executable)
    trees: List[str] = []
    symlinks: List[Tuple[str, str]] = []
    for directory in _LIBRARY_DIRS:
        if os.path.islink(directory):
            symlinks.append((os.readlink(directory), directory))
        elif os.path.isdir(directory):
            trees.append(directory)
    prefix_lib = os.path.join(os.path.dirname(os.path.dirname(interpreter)), "lib")  # libpython, libffi (conda)
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}  # not a virtual environment's
    standard = [sysconfig.get_path(name, vars=base) for name in ("stdlib", "platstdlib")]
    standard.append(sysconfig.get_config_var("DESTSHARED"))  # lib-dynload
    for directory in [prefix_lib, *standard]:
        if directory and os.path.isdir(directory):
            directory = os.path.realpath(directory)
            if not any(_inside(directory, tree) for tree in trees):
                trees.append(directory)
    hidden = sorted(
        {
            os.path.realpath(found)
            for tree in trees
            for pattern in ("*-packages", "python3*/*-packages")
            for found in glob.glob(os.path.join(tree, pattern))
            if os.path.isdir(found)
        }
    )
    read_only = [(tree, tree) for tree in trees] + [(f, f) for f in _LIBRARY_FILES if os.path.isfile(f)]
    read_only.append((interpreter, interpreter))
    entries = package_entries(packages)
    read_only += [(host, f"{SANDBOX_PACKAGES}/{name}") for name, host in sorted(entries.items())]
    package_dirs = tuple(sorted({os.path.dirname(host) for host in entries.values()}))
    return SandboxView(interpreter, tuple(read_only), tuple(symlinks), tuple(hidden), packages, package_dirs)


def package_entries(packages: Sequence[str]) -> Dict[str, str]:
    """{top-level name: host path} of every file and directory the distributions providing
    ``packages`` installed, and of the distributions they require (numpy: numpy, numpy.libs,
    numpy-X.dist-info; sympy: sympy, isympy.py, mpmath ...). Raises ValueError naming a package
    that is not installed."""
    if not packages:
        return {}
    from importlib import metadata

    from packaging.requirements import Requirement

    providers = metadata.packages_distributions()
    queue: List[str] = []
    for name in packages:
        if name not in providers:
            raise ValueError(f"package {name!r} is not installed (pip install {name}), or drop it from packages")
        queue += providers[name]
    entries: Dict[str, str] = {}
    seen = set()
    while queue:
        distribution_name = queue.pop()
        try:
            distribution = metadata.distribution(distribution_name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement that is not installed; its importer copes without it
        if distribution.metadata["Name"].lower() in seen:
            continue
        seen.add(distribution.metadata["Name"].lower())
        for file in distribution.files or ():
            top = file.parts[0]
            # Scripts (../bin), .pth hooks and the shared __pycache__ of single-file modules stay out.
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue
            host = os.path.realpath(str(distribution.locate_file(top)))
            if os.path.exists(host):
                entries.setdefault(top, host)
        for line in distribution.requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                queue.append(requirement.name)
    return entries


def _inside(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")
