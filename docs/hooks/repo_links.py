"""MkDocs hook: relative links from the docs to files of the repository outside ``docs/``.

The pages link to repository files by their relative path (``../BENCHMARKS.md``,
``../examples/async_grpo_harbor/README.md``), which works wherever the repository is read as files. The
site cannot reach above its root, so each such file (and, transitively, the repository files its own
markdown links to) is put into the site under ``repo/<its path>`` at build time, and the links are
rewritten to it; links from those files back into ``docs/`` are rewritten to the doc pages. A link to a
file that does not exist is left alone, so ``mkdocs build --strict`` reports it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, InclusionLevel

MOUNT = "repo"
LINK = re.compile(r"(\]\()(<?)([^)\s>]+)(>?)((?:\s+\"[^\"]*\")?\))")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _targets(text: str) -> list[str]:
    text = FENCE.sub("", text)
    return [m.group(3) for m in LINK.finditer(text)]


def _local(url: str) -> str | None:
    """The path part of a relative link, or None for URLs, anchors and absolute paths."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", url) or url.startswith(("#", "/")):
        return None
    return url.split("#", 1)[0] or None


def _roots(config: Any) -> tuple[Path, Path]:
    return Path(config.config_file_path).resolve().parent, Path(config.docs_dir).resolve()


def _origin(file: File, root: Path, docs: Path) -> Path:
    """Where a site file's markdown really lives (a mounted file: its place in the repository)."""
    if file.src_uri.startswith(MOUNT + "/"):
        return root / file.src_uri[len(MOUNT) + 1 :]
    return docs / file.src_uri


def on_files(files: Any, config: Any) -> Any:
    root, docs = _roots(config)
    queue = [Path(f.abs_src_path) for f in files.documentation_pages() if f.abs_src_path]
    mounted: set[Path] = set()
    while queue:
        origin = queue.pop()
        for url in _targets(origin.read_text(encoding="utf-8")):
            path = _local(url)
            if path is None:
                continue
            target = (origin.parent / path).resolve()
            if not target.is_file() or target.is_relative_to(docs) or not target.is_relative_to(root):
                continue
            if target not in mounted:
                mounted.add(target)
                if target.suffix == ".md":
                    queue.append(target)
    for target in sorted(mounted):
        src_uri = f"{MOUNT}/{target.relative_to(root).as_posix()}"
        files.append(
            File.generated(config, src_uri, abs_src_path=str(target), inclusion=InclusionLevel.NOT_IN_NAV)
        )
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    root, docs = _roots(config)
    origin = _origin(page.file, root, docs)
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match[str]) -> str:
        url = match.group(3)
        path = _local(url)
        if path is None:
            return match.group(0)
        target = (origin.parent / path).resolve()
        if not target.exists():
            return match.group(0)
        if target.is_relative_to(docs):
            src_uri = target.relative_to(docs).as_posix()
        elif target.is_relative_to(root) and target.is_file():
            src_uri = f"{MOUNT}/{target.relative_to(root).as_posix()}"
        else:
            return match.group(0)
        new = posixpath.relpath(src_uri, here or ".") + url[len(url.split("#", 1)[0]) :]
        return f"{match.group(1)}{match.group(2)}{new}{match.group(4)}{match.group(5)}"

    parts = re.split(r"(^(?:```|~~~).*?^(?:```|~~~)[^\n]*$)", markdown, flags=re.S | re.M)
    return "".join(part if i % 2 else LINK.sub(rewrite, part) for i, part in enumerate(parts))
