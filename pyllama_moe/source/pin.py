"""The pinned upstream: read once from patches/pin.toml."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import lru_cache

from pyllama_moe.errors import UserError
from pyllama_moe.paths import PIN_FILE


@dataclass(frozen=True)
class Pin:
    package: str
    version: str
    filename: str
    sha256: str
    llama_path: str
    commit: str
    commit_full: str
    python_package: str

    @property
    def label(self) -> str:
        return f"{self.package}=={self.version} llama.cpp@{self.commit}"


@lru_cache(maxsize=1)
def load_pin() -> Pin:
    try:
        data = tomllib.loads(PIN_FILE.read_text())
        sdist, llama = data["sdist"], data["llama_cpp"]
        return Pin(
            package=sdist["package"], version=sdist["version"], filename=sdist["filename"],
            sha256=sdist["sha256"].lower(), llama_path=llama["path"], commit=llama["commit"],
            commit_full=llama["commit_full"], python_package=llama["python_package"],
        )
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"{PIN_FILE}: unreadable pin ({exc})", "restore it with `git checkout patches/pin.toml`") from exc
