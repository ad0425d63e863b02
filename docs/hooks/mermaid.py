"""MkDocs hook: the site carries its own copy of mermaid, so its diagrams render offline.

The theme draws ``mermaid`` code blocks with the mermaid library, which it loads from a
CDN unless the page already defines ``mermaid``. ``mkdocs.yml`` loads
``javascripts/mermaid.min.js`` on every page (``extra_javascript``); this hook puts that
file into the built site: mermaid's own release from the npm registry, at the version
pinned here, checked against the registry's sha512 before use, and kept in
``~/.cache/ps-docs`` so that later builds need no network. Where the build machine cannot
fetch it, the build says so in one line and the pages fall back to the CDN.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import os
import tarfile
import urllib.request
from pathlib import Path
from typing import Any

VERSION = "11.17.2"
TARBALL = f"https://registry.npmjs.org/mermaid/-/mermaid-{VERSION}.tgz"
# dist.integrity of that release on the registry (npm view mermaid@VERSION dist.integrity).
INTEGRITY = "sha512-V6K3C8EBdEsPFZXSKMJe6ppQOENxuHARr9GvHX4hh47lAbhMRD9qf4oEK7LoaRQxULMa80/qt5gHO73aCleBBg=="
MEMBER = "package/dist/mermaid.min.js"
TARGET = "javascripts/mermaid.min.js"  # as mkdocs.yml's extra_javascript names it

log = logging.getLogger("mkdocs.hooks.mermaid")


def _cached() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ps-docs"
    return root / f"mermaid-{VERSION}.min.js"


def _fetch() -> bytes:
    with urllib.request.urlopen(TARBALL, timeout=20) as response:
        tarball = response.read()
    digest = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    if digest != INTEGRITY:
        raise ValueError(f"{TARBALL}: sha512 {digest} is not the pinned {INTEGRITY}")
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
        member = tar.extractfile(MEMBER)
        if member is None:
            raise ValueError(f"{TARBALL} has no {MEMBER}")
        return member.read()


def on_post_build(config: Any, **kwargs: Any) -> None:
    cached = _cached()
    if not cached.is_file():
        try:
            script = _fetch()
        except Exception as exc:  # no network, a truncated download, another file: the CDN then
            log.info("mermaid %s not fetched (%s): the diagrams load it from the CDN", VERSION, exc)
            return
        cached.parent.mkdir(parents=True, exist_ok=True)
        temp = cached.with_name(f".{cached.name}.{os.getpid()}")
        temp.write_bytes(script)
        temp.replace(cached)
    target = Path(config["site_dir"]) / TARGET
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(cached.read_bytes())
