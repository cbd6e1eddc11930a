"""vovp's build backend: maturin's, plus the daemon and the CLI in the wheel.

``pip install ./python`` builds the extension (``vovp._native``, the client only: it links
neither the store nor its actors) with maturin, as before, and before that builds the
``vovp-engine`` daemon and the ``vovp`` CLI in release mode from this workspace and stages them
in ``wheel-data/scripts``; maturin packs that folder as the wheel's ``.data/scripts``, which pip
installs beside the interpreter, on PATH. ``vovp.start_store`` runs the daemon found there.

Every hook maturin offers is re-exported unchanged except the two that make wheels.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import maturin
from maturin import (  # noqa: F401  (PEP 517 hooks, re-exported)
    build_sdist,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_wheel,
)

PYTHON_DIR = Path(__file__).resolve().parent.parent
WORKSPACE = PYTHON_DIR.parent
# [tool.maturin] data = "wheel-data" in pyproject.toml.
SCRIPTS = PYTHON_DIR / "wheel-data" / "scripts"
BINARIES = ("vovp-engine", "vovp")
# maturin reads the data folder for every hook (metadata too): it must exist before any of them.
SCRIPTS.mkdir(parents=True, exist_ok=True)


def stage_binaries() -> list[Path]:
    """Builds the daemon and the CLI (release) and copies them into ``SCRIPTS``."""
    cargo = os.environ.get("CARGO", "cargo")
    command = [cargo, "build", "--release", "-p", "vovp-transport", "--message-format=json"]
    command += [f"--bin={b}" for b in BINARIES]
    built = subprocess.run(
        command, cwd=WORKSPACE, stdout=subprocess.PIPE, text=True, check=False
    )
    if built.returncode != 0:
        raise RuntimeError(
            f"building vovp-engine and vovp failed ({' '.join(command)}, exit {built.returncode})"
        )
    found = {}
    for line in built.stdout.splitlines():
        message = json.loads(line)
        executable = message.get("executable")
        if message.get("reason") == "compiler-artifact" and executable:
            found[Path(executable).name] = Path(executable)
    missing = [b for b in BINARIES if b not in found]
    if missing:
        raise RuntimeError(f"cargo built no {', '.join(missing)}")
    if SCRIPTS.exists():
        shutil.rmtree(SCRIPTS)
    SCRIPTS.mkdir(parents=True)
    staged = []
    for name in BINARIES:
        target = SCRIPTS / name
        shutil.copy2(found[name], target)
        # The workspace's release profile keeps line tables (debug = 1) for profiling; a wheel
        # does not need them (~70 MB of the two binaries).
        if shutil.which("strip"):
            subprocess.run(["strip", "--strip-debug", str(target)], check=False)
        staged.append(target)
    return staged


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    stage_binaries()
    return maturin.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    stage_binaries()
    return maturin.build_editable(wheel_directory, config_settings, metadata_directory)
