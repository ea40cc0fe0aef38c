"""Export a checkpoint's weights as a plain ``model.safetensors`` (+ JSON configs)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from lightlike.checkpoint.files import CONFIG_FILE, HPARAMS_FILE, WEIGHTS_FILE
from lightlike.checkpoint.manifest import CHECKPOINT_DIR_NAME, MANIFEST, find_latest_valid, verify_checkpoint
from lightlike.errors import CheckpointError

log = logging.getLogger("lightlike")

#: Consolidators for sharded layouts (manifest meta ``state_format``): "module:function", called as
#: ``function(checkpoint_dir, out_file)`` to write one ``model.safetensors`` from the shards.
CONSOLIDATORS: dict[str, str] = {
    "dcp": "lightlike.checkpoint.dcp:consolidate_to_safetensors",
    "deepspeed": "lightlike.checkpoint.zero:consolidate_to_safetensors",
}

#: What an export writes; a folder holding nothing else is taken for an earlier export.
EXPORTED = (WEIGHTS_FILE, HPARAMS_FILE, CONFIG_FILE)
_TEMP = re.compile(rf"^\.(?:{'|'.join(map(re.escape, EXPORTED))})\.tmp-\d+$")  # an interrupted export's


def export_weights(checkpoint_dir: str | Path, out_dir: str | Path, hashes: bool = True) -> Path:
    """Verify ``checkpoint_dir`` (a checkpoint, or a run's ``output_dir``: its newest valid
    checkpoint, ``checkpoint_of``) and write ``out_dir/model.safetensors`` (plus ``hparams.json``
    and ``config.json`` when the checkpoint has them). Returns the path of the weights.

    ``out_dir`` is new, empty, an earlier export (it holds nothing but those three files: they
    are replaced, with a warning, and an earlier ``hparams.json``/``config.json`` that this
    checkpoint lacks is removed, so the folder describes one model), or ``checkpoint_dir``
    itself when it is a full checkpoint (its files are left as they are; a sharded one is refused:
    a ``model.safetensors`` its manifest does not list would make loading it refuse it). Any other
    folder, a checkpoint above all, is refused with a ``CheckpointError`` before anything is
    written: nothing that an export did not write is overwritten. Every file is written aside
    first and renamed into place only when all are written, so a failure part-way (a full disk)
    leaves an earlier export as it was, and no folder that the export created.

    Sharded checkpoints (FSDP's DCP shards, DeepSpeed's ZeRO partitions) are consolidated into
    the same single file by the consolidator their ``state_format`` names."""
    src = checkpoint_of(checkpoint_dir, hashes)
    manifest = verify_checkpoint(src, hashes=hashes)
    fmt = (manifest.get("meta") or {}).get("state_format", "full")
    out = Path(out_dir)
    in_place = out.is_dir() and out.samefile(src)
    if not in_place:
        _check_out_dir(out)
    consolidated = not (src / WEIGHTS_FILE).is_file()
    if consolidated and fmt not in CONSOLIDATORS:
        raise CheckpointError(f"{src} has no model.safetensors to export (state_format={fmt!r})")
    if consolidated and in_place:  # a file its manifest does not list: loading the checkpoint would refuse it
        raise CheckpointError(f"export: {str(src)!r} is sharded ({fmt}); export it into another folder, not into "
                              f"the checkpoint itself (a model.safetensors its {MANIFEST} does not list would make "
                              "loading the checkpoint refuse it)")
    if in_place:  # a full checkpoint: its own files are already there, and are left as they are
        return out / WEIGHTS_FILE
    # decided before anything is written: what of an earlier export this one replaces or removes
    replaced = [name for name in EXPORTED if (out / name).is_file()]
    with new_folder(out):
        _write(src, out, fmt, consolidated)
    if replaced:
        log.warning("export into %s replaced %s of an earlier export", out, ", ".join(replaced))
    return out / WEIGHTS_FILE


def _write(src: Path, out: Path, fmt: str, consolidated: bool) -> None:
    """The export's files written aside in ``out``, then renamed into place (the weights last)."""
    # every file is written aside first, and only then are all renamed into place: a failure
    # while writing (a full disk, a consolidation error) leaves an earlier export whole, never
    # this checkpoint's weights beside that export's hparams.json/config.json
    temps: dict[str, Path] = {}
    try:
        for name in EXPORTED:
            tmp = out / f".{name}.tmp-{os.getpid()}"
            if name == WEIGHTS_FILE and consolidated:
                module_name, fn_name = CONSOLIDATORS[fmt].split(":")
                temps[name] = tmp
                getattr(importlib.import_module(module_name), fn_name)(src, tmp)
            elif (src / name).is_file():
                temps[name] = tmp
                shutil.copyfile(src / name, tmp)
        for tmp in temps.values():
            fsync_file(tmp)
        # the renames follow one another at once (only a kill between two of them could still
        # mix the two exports; loading would then name the shapes that do not fit)
        for name in (HPARAMS_FILE, CONFIG_FILE, WEIGHTS_FILE):  # the weights last
            if name in temps:
                os.replace(temps.pop(name), out / name)
            elif name != WEIGHTS_FILE and (out / name).is_file():
                (out / name).unlink()  # an earlier export's: it would describe another model
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)


def checkpoint_of(src: str | Path, hashes: bool = True, what: str = "export",
                  say: Callable[[str], None] | None = None) -> Path:
    """The checkpoint that ``src`` names: ``src`` itself when it is one (or any folder that is not
    a run's ``output_dir``: verified by the caller), else the newest valid checkpoint of the run's
    ``output_dir`` ``src``, with a line naming it and the newer ones skipped (to ``say``; default:
    the log). A missing path, a file, or an ``output_dir`` without a valid checkpoint is a
    ``CheckpointError`` beginning with ``what``."""
    src = Path(src)
    if not src.exists():
        raise CheckpointError(f"{what}: no such checkpoint directory: {str(src)!r}")
    if not src.is_dir():
        raise CheckpointError(f"{what}: {str(src)!r} is a file, not a checkpoint directory")
    if (src / MANIFEST).exists() or not any(p.is_dir() and CHECKPOINT_DIR_NAME.match(p.name) for p in src.iterdir()):
        return src
    skipped: list[tuple[Path, str]] = []
    with warnings.catch_warnings():  # each skipped one is named below, with the one used
        warnings.simplefilter("ignore")
        newest = find_latest_valid(src, hashes=hashes, skipped=skipped)
    reasons = "; ".join(f"{p.name} ({why})" for p, why in skipped)
    if newest is None:
        raise CheckpointError(f"{what}: {str(src)!r} is a run's output_dir, not one checkpoint, and holds no valid "
                              "checkpoint" + (f": {reasons}" if skipped else ""))
    note = f"{what} {src}: using {newest.name}, the newest valid checkpoint" + (
        f"; skipped the newer {reasons}" if skipped else "")
    if say is not None:
        say(note)
    else:
        log.log(logging.WARNING if skipped else logging.INFO, "%s", note)
    return Path(newest)


@contextlib.contextmanager
def new_folder(out: Path) -> Iterator[None]:
    """``out`` created (with its missing parents) for the body; where the body fails, the folders
    this created are removed again, each only while it is empty (nothing else is ever deleted)."""
    created = [p for p in (out, *out.parents) if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for p in created:  # the deepest first
            try:
                p.rmdir()
            except OSError:  # not empty (or gone): left as it is
                break
        raise


def _check_out_dir(out: Path) -> None:
    """Refuse an ``out_dir`` that is a file, a checkpoint, or a folder holding more than an
    earlier export: its files were not written by an export and must not be overwritten."""
    if not out.exists():
        return
    if not out.is_dir():
        raise CheckpointError(f"export: OUT_DIR {str(out)!r} is a file, not a directory: choose another OUT_DIR")
    if (out / MANIFEST).is_file():
        raise CheckpointError(
            f"export: OUT_DIR {str(out)!r} is a checkpoint (it holds {MANIFEST}); exporting into it would overwrite "
            "its files and leave it damaged: choose a new or empty OUT_DIR")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in EXPORTED and not _TEMP.match(p.name))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise CheckpointError(
            f"export: OUT_DIR {str(out)!r} holds files that no export wrote ({shown}); an export goes into a new "
            f"or empty folder, or replaces an earlier export (a folder holding only {', '.join(EXPORTED)}): "
            "choose another OUT_DIR, or move those files away")


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to disk."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_replace(tmp: Path, dest: Path) -> None:
    """Flush ``tmp`` to disk, then rename it over ``dest`` (readers see the old file or the new one)."""
    fsync_file(tmp)
    os.replace(tmp, dest)
