"""Where the project keeps what it downloads and builds.

Everything lives under one cache root: `$PYLLAMA_MOE_HOME`, else `$XDG_CACHE_HOME/pyllama-moe`, else
`~/.cache/pyllama-moe`. Build directories are keyed by content, so a shared root is safe.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PATCHES_DIR = PROJECT_ROOT / "patches"
NATIVE_DIR = PROJECT_ROOT / "native"
CI_DIR = PROJECT_ROOT / "ci"
PIN_FILE = PATCHES_DIR / "pin.toml"
SERIES_FILE = PATCHES_DIR / "series"


def cache_root() -> Path:
    env = os.environ.get("PYLLAMA_MOE_HOME")
    if env:
        return Path(env).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return (base / "pyllama-moe").resolve()


def cache_dir(*parts: str) -> Path:
    path = cache_root().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
