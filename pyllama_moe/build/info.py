"""What a patched libllama says about the build it came from (`llama_moe_build_info`), and the rule that it
must name the build that was asked for.

Pure Python with no imports of the project: the worker process uses it right after loading the library through
ctypes, before llama_cpp, and the loader (ffi.py) uses it after loading the library through cffi.
"""

from __future__ import annotations

from pathlib import Path


def parse_build_info(text: str) -> dict[str, str]:
    """"key=...;variant=...;pin=..." as a dict."""
    return dict(part.split("=", 1) for part in text.split(";") if "=" in part)


def embedded_mismatch(variant: str, key: str, info: dict[str, str] | None, path: Path) -> str | None:
    """Why the library at `path`, which embeds `info` (None: it exports no llama_moe_build_info), is not the
    `variant` build `key`; None when it is. A master build embeds nothing."""
    if variant == "master":
        return f"{path} exports llama_moe_build_info, so it is not a master build" if info is not None else None
    if info is None:
        return f"{path} has no llama_moe_build_info: it is not a patched build"
    if info.get("key") != key or info.get("variant") != variant:
        return f"{path} embeds key {info.get('key')} ({info.get('variant')}), not the {variant} build {key}"
    return None
