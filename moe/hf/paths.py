"""Opening a file that a model directory names, without ever leaving that directory.

A checkpoint directory is input from elsewhere (downloaded, shared): the names it holds (a sharded index's
`weight_map`, its config and tokenizer files) are resolved after symlinks and must land inside the directory.
The one exception is the HuggingFace Hub cache, whose snapshot files are symlinks into the same repository's
blob store: `models--ORG--NAME/snapshots/REV/x -> ../../blobs/HASH`; those may land in `models--ORG--NAME/blobs/`.
"""

import os
import stat
from pathlib import Path


class OutsideDirectoryError(ValueError):
    """A name inside a model directory that points out of it; the one-line message names the entry."""


def file_inside(directory, name: str, what: str) -> Path:
    """DIR/name resolved after symlinks, refused (OutsideDirectoryError naming `what`) when `name` is absolute,
    climbs out with '..', resolves anywhere but inside DIR (or the Hub cache's blob store of DIR's repo), or is a
    special file (a FIFO, socket or device: reading one blocks or never ends). The file need not exist: callers
    check that after, with their own message."""
    root = Path(directory).resolve()
    if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in Path(name).parts:
        raise OutsideDirectoryError(f"{what} {name!r} is not a plain relative file name; a checkpoint's files "
                                    f"must lie inside its directory {root}")
    target = (root / name).resolve()
    if not any(target.is_relative_to(allowed) for allowed in _allowed_roots(root)):
        raise OutsideDirectoryError(f"{what} {name!r} resolves to {target}, outside the model directory {root}; "
                                    "a checkpoint's files must lie inside its directory (copy them in)")
    _refuse_special(target, f"{what} {name!r}")
    return target


def _refuse_special(target: Path, what: str) -> None:
    """OutsideDirectoryError unless `target` is missing, a regular file or a directory."""
    try:
        mode = target.stat().st_mode
    except OSError:
        return  # missing (or dangling): the reader reports it with its own message
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise OutsideDirectoryError(f"{what} is not a regular file (a FIFO, socket or device); a checkpoint holds "
                                    "regular files only")


def _allowed_roots(root: Path) -> list[Path]:
    """DIR itself, plus `models--X/blobs` when DIR is a Hub cache snapshot `models--X/snapshots/REV`."""
    roots = [root]
    repo = root.parent.parent
    if root.parent.name == "snapshots" and repo.name.startswith("models--"):
        roots.append(repo / "blobs")
    return roots


def tree_inside(directory, name: str, what: str) -> Path:
    """DIR/name and every entry below it, each resolved after symlinks inside DIR (or the Hub cache's blob store of
    DIR's repo): a reader that walks the tree (orbax, tensorstore) then never leaves DIR. Symlinked directories that
    stay inside are walked too. Special files (FIFOs, sockets, devices) are refused as well: reading one blocks or
    never ends. Raises OutsideDirectoryError naming the first entry that fails."""
    top = file_inside(directory, name, what)
    allowed = _allowed_roots(Path(directory).resolve())
    pending, seen = [Path(directory) / name], set()
    while pending:
        path = pending.pop()
        target = path.resolve()
        if not any(target.is_relative_to(a) for a in allowed):
            raise OutsideDirectoryError(f"{what} entry {path} resolves to {target}, outside the directory "
                                        f"{Path(directory).resolve()}; a checkpoint's files must lie inside its "
                                        "directory (copy them in)")
        _refuse_special(target, f"{what} entry {path}")
        if target.is_dir() and target not in seen:
            seen.add(target)
            pending.extend(path.iterdir())
    return top
