"""Replace a directory by two renames, so that a crash leaves either the old or the new one, and finish a
replacement that a crash interrupted.

The protocol, for a directory ``PATH`` and a random ``TOKEN`` per save (one writer per path at a time;
readers may run concurrently). Every sibling sits next to ``PATH``, on the same filesystem, so each
rename is atomic:

1. The writer fills ``PATH.torchlike-new-TOKEN`` completely.
2. ``PATH`` is renamed to ``PATH.torchlike-old-TOKEN`` (skipped when ``PATH`` does not exist).
3. ``PATH.torchlike-new-TOKEN`` is renamed to ``PATH``.
4. The writer deals with the backup (carries over what it keeps, then deletes it) and deletes the
   leftovers of earlier interrupted saves.

Step 2 happens only once step 1 is finished, so a backup ``old-TOKEN`` proves that ``new-TOKEN`` beside
it is complete: a crash between steps 2 and 3 leaves ``PATH`` missing with that pair beside it, and
``finish_interrupted_swap`` completes the swap. A ``new-TOKEN`` without its backup may be unfinished
(or still being written) and is never moved into place.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

NEW_TAG = ".torchlike-new-"
OLD_TAG = ".torchlike-old-"
TRASH_TAG = ".torchlike-trash-"
_KINDS = (("new", NEW_TAG), ("old", OLD_TAG), ("trash", TRASH_TAG))


def sibling(path: Path, tag: str, token: str) -> Path:
    """``PATH<tag><token>``: the staging folder, backup or trash of one save to ``path``."""
    return path.with_name(path.name + tag + token)


def siblings(path: Path) -> list[tuple[str, Path]]:
    """Leftovers of saves to ``path``: ("new" | "old" | "trash", directory), in name order."""
    found = []
    try:
        children = sorted(path.parent.iterdir())
    except OSError:
        return []  # no parent folder (e.g. a hub id), or one that cannot be listed: nothing to finish
    for child in children:
        for kind, tag in _KINDS:
            if child.name.startswith(path.name + tag):
                found.append((kind, child))
    return found


def fsync_dir(directory: Path) -> None:
    """Makes the renames inside ``directory`` durable, where the filesystem allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some filesystems cannot open directories; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def swap_into_place(staging: Path, path: Path, token: str, stage: Callable[[str], None]) -> Path | None:
    """Steps 2 and 3: moves the complete ``staging`` folder (named ``sibling(path, NEW_TAG, token)``) to
    ``path``.

    Args:
        staging: the complete new directory.
        path: where it goes; an existing directory there is kept as the backup.
        token: the save's token, shared by the staging folder and the backup.
        stage: called with ``"old-moved"`` (between the renames) and ``"swapped"``; the crash tests kill
            the process there.

    Returns:
        The backup ``PATH.torchlike-old-TOKEN`` the caller must deal with, or None when ``path`` did not
        exist.

    Raises:
        OSError: ``path`` could not be moved aside (``staging`` is deleted, ``path`` is untouched).
    """
    backup = None
    if os.path.lexists(path):
        backup = sibling(path, OLD_TAG, token)
        try:
            os.rename(path, backup)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        stage("old-moved")
    os.rename(staging, path)
    fsync_dir(path.parent)
    stage("swapped")
    return backup


def finish_interrupted_swap(path: Path, finish_backup: Callable[[Path, Path], None]) -> None:
    """Brings ``path`` back to the state a finished swap leaves, from whatever a crash left.

    When ``path`` is missing, the staging folder whose backup sits beside it is moved into place (the
    swap was between its renames); failing that, a lone backup is moved back. Then every backup is
    handed to ``finish_backup(backup, path)`` (which carries over what the caller keeps and deletes
    it) and trash is deleted; where that fails (a read-only filesystem) ``path`` is complete anyway
    and the next save tries again. Staging folders without a backup are left alone: they may
    belong to a save still running.

    Raises:
        OSError: ``path`` is missing and the complete copy could not be moved there; the message
            says how to do it by hand.
    """
    leftovers = siblings(path)
    if not leftovers:
        return
    if not os.path.lexists(path):
        backups = {directory.name.removeprefix(path.name + OLD_TAG): directory
                   for kind, directory in leftovers if kind == "old"}
        finished = [directory for kind, directory in leftovers
                    if kind == "new" and directory.name.removeprefix(path.name + NEW_TAG) in backups]
        candidates = finished or list(backups.values())
        if candidates:
            # Several candidates need several crashes in a row; the last one renamed is the newest.
            source = max(candidates, key=lambda directory: directory.stat().st_ctime_ns)
            try:
                os.rename(source, path)
            except OSError as error:
                raise OSError(
                    f"An interrupted save left {path} missing and its complete copy in {source}; moving it back "
                    f"failed ({error}). Rename {source} to {path} by hand."
                ) from error
            fsync_dir(path.parent)
    for kind, directory in siblings(path):
        if kind == "old":
            try:
                finish_backup(directory, path)
            except OSError:
                pass
        elif kind == "trash":
            shutil.rmtree(directory, ignore_errors=True)
