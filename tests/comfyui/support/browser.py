"""The real ComfyUI frontend and a headless Chromium for the browser tests.

The frontend is the comfyui-frontend-package that the ComfyUI under test pins (its
requirements.txt), installed by scripts/setup_env.sh into .frontend/<version>/. Chromium
is Debian's (/usr/bin/chromium, or RINGSWAP_CHROMIUM), driven by the playwright package
(never its own browser download). A missing piece fails the test in CI (CI=true) and
skips it elsewhere, always with the reason.
"""
from __future__ import annotations

import os
import re
import shutil

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def unavailable(reason: str):
    """Fail in CI, skip elsewhere: a browser test never passes silently without a browser."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(reason)
    pytest.skip(reason)


def frontend_version(comfy_dir: str) -> str:
    with open(os.path.join(comfy_dir, "requirements.txt"), encoding="utf-8") as f:
        m = re.search(r"^comfyui-frontend-package==(\S+)", f.read(), re.M)
    if m is None:
        raise RuntimeError(f"{comfy_dir}/requirements.txt pins no comfyui-frontend-package")
    return m.group(1)


def frontend_root(comfy_dir: str) -> str:
    """The static folder of the frontend this ComfyUI pins (for --front-end-root)."""
    version = frontend_version(comfy_dir)
    root = os.path.join(REPO, ".frontend", version, "comfyui_frontend_package", "static")
    if not os.path.isfile(os.path.join(root, "index.html")):
        unavailable(f"comfyui-frontend-package=={version} is not installed in {root}: run scripts/setup_env.sh")
    return root


def chromium_path() -> str:
    path = os.environ.get("RINGSWAP_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.isfile(path):
        unavailable(f"no Chromium at {path}: install Debian's chromium (apt-get install -y chromium), "
                    "as scripts/setup_env.sh does")
    return path


def launch(playwright):
    """A headless Chromium from the system, or the reason it cannot start."""
    try:
        return playwright.chromium.launch(executable_path=chromium_path(), headless=True,
                                          args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
    except Exception as e:   # playwright's Error: the browser did not start
        unavailable(f"Chromium did not start: {e}")


def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright as start
    except ImportError as e:
        unavailable(f"the playwright package is missing ({e}): pip install -r requirements-dev.txt")
    return start()
