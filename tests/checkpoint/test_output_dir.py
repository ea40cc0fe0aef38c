"""output_dir: one fit at a time (an OS lock that dies with its process); nothing lightlike did not
write is deleted (moved aside instead); a read-only path is refused at set-up and a read-only old
checkpoint does not stop rotation; every file of a checkpoint has one mode; a save that runs out
of room says so. Real processes, real locks, real read-only files, real file-size limits."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import Classifier, DictDataset, run_killing_group

import lightlike as ll
from lightlike.checkpoint import CheckpointWriter, list_checkpoints, verify_checkpoint
from lightlike.checkpoint.lock import LOCK_NAME, OutputDirLock

TESTS = Path(__file__).resolve().parents[1]
QUIET = dict(loggers=[], progress_bar=False, model_summary=False, batch_size=4)


def fit(out, callbacks=(), **kw):
    torch.manual_seed(0)
    cfg = {**QUIET, "max_steps": 2, "save_every": 2, **kw}
    return ll.Fitter(output_dir=str(out), callbacks=list(callbacks), **cfg).fit(Classifier(), DictDataset(n=16))


def script(tmp_path, body):
    """A script in tmp_path that imports lightlike and the test helpers, then runs ``body``."""
    path = tmp_path / "target.py"
    path.write_text(f"import os, sys, time\nsys.path.insert(0, {str(TESTS)!r})\nimport lightlike as ll\n"
                    f"from helpers import Classifier, DictDataset\n{body}")
    return path


@contextlib.contextmanager
def read_only(path):
    """``path`` made read-only for real: chmod where this is not root; as root (whom chmod does
    not stop) the immutable attribute (chattr +i). Skips where neither stops a write."""
    path = Path(path)
    if os.geteuid() != 0:
        mode = stat.S_IMODE(path.stat().st_mode)
        os.chmod(path, 0o555)
        undo = lambda: os.chmod(path, mode)  # noqa: E731
    else:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
            pytest.skip("running as root: chmod does not stop writes, and chattr +i is not available here")
        undo = lambda: subprocess.run(["chattr", "-i", str(path)], check=True)  # noqa: E731
    try:
        try:
            (path / ".probe").touch()
        except OSError:
            pass
        else:
            (path / ".probe").unlink()
            pytest.skip(f"{path} is still writable")
        yield
    finally:
        undo()


# ---- one fit per output_dir ------------------------------------------------------------------
HOLDER = """
out, lr, gate = sys.argv[1], float(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None

class Hold(ll.Callback):
    def on_step_end(self, fitter, state, control):  # holds output_dir until the test says go
        if gate and state.global_step == 1:
            open(gate + ".holding", "w").close()
            while not os.path.exists(gate):
                time.sleep(0.05)

ll.Fitter(output_dir=out, max_steps=2, save_every=2, batch_size=4, learning_rate=lr, loggers=[],
          progress_bar=False, model_summary=False, callbacks=[Hold()]).fit(Classifier(), DictDataset(n=16))
"""


def test_a_second_run_into_a_held_output_dir_is_refused_and_a_killed_holder_leaves_no_stale_lock(tmp_path):
    """Two processes into one output_dir (different learning rates): both exited 0 and every
    checkpoint-N held one run's files. Now the second is refused at start, naming the holder's pid
    and host; once the holder is SIGKILLed (its lock file left behind), a new run takes the
    directory: the kernel released the lock with the process."""
    target, out, gate = script(tmp_path, HOLDER), tmp_path / "run", tmp_path / "go"
    first = subprocess.Popen([sys.executable, str(target), str(out), "1e-3", str(gate)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not Path(f"{gate}.holding").exists():  # the first run is training, inside its lock
            assert first.poll() is None, first.communicate()[0][-3000:]
            time.sleep(0.05)
        second = run_killing_group([sys.executable, str(target), str(out), "1e-2"], timeout=300)
        assert second.returncode != 0
        assert f"ConfigError: output_dir {str(out)!r} is in use by another run: process {first.pid} on host " \
               f"{socket.gethostname()}" in second.stderr, second.stderr[-3000:]
        assert "choose another output_dir" in second.stderr
        assert list_checkpoints(out) == []  # the second run wrote nothing
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert (out / LOCK_NAME).is_file()  # the killed holder's file, whose lock died with it
    third = run_killing_group([sys.executable, str(target), str(out), "1e-2"], timeout=300)
    assert third.returncode == 0, third.stderr[-3000:]
    [ckpt] = list_checkpoints(out)
    verify_checkpoint(ckpt)
    assert '"learning_rate": 0.01' in (ckpt / "config.json").read_text()
    assert not (out / LOCK_NAME).exists()  # released at the end of the fit


def test_the_lock_is_held_during_the_fit_and_released_after_an_error(tmp_path):
    """In one process: a lock held (here by the test, through another open file) refuses a fit
    naming this pid; a fit that fails releases its lock, so the next fit into the directory runs."""
    out = tmp_path / "run"
    held = OutputDirLock(out)
    held.acquire()
    try:
        with pytest.raises(ll.ConfigError, match=f"is in use by another run: process {os.getpid()} on host"):
            fit(out)
    finally:
        held.release()

    class Boom(ll.Callback):
        def on_step_end(self, fitter, state, control):
            assert (out / LOCK_NAME).is_file()  # held while training
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fit(out, [Boom()])
    assert not (out / LOCK_NAME).exists()
    assert fit(out).global_step == 2


# ---- nothing lightlike did not write is deleted ------------------------------------------------
def test_another_tools_checkpoint_folder_survives_a_save_of_its_step(tmp_path, caplog):
    """A checkpoint-2/ without a lightlike manifest (another tool's pytorch_model.bin) was
    deleted when step 2 was saved. It is moved into set-aside-<time>/, bytes unchanged, with a
    warning naming where; checkpoint-2 is then lightlike's."""
    out = tmp_path / "run"
    foreign = out / "checkpoint-2" / "pytorch_model.bin"
    foreign.parent.mkdir(parents=True)
    payload = os.urandom(4096)
    foreign.write_bytes(payload)
    fit(out)
    [aside] = [p for p in out.iterdir() if p.name.startswith("set-aside-")]
    assert (aside / "checkpoint-2" / "pytorch_model.bin").read_bytes() == payload
    assert f"moved it to {aside / 'checkpoint-2'}" in caplog.text and "no lightlike manifest" in caplog.text
    assert verify_checkpoint(out / "checkpoint-2")["step"] == 2
    assert not (out / "checkpoint-2" / "pytorch_model.bin").exists()


def test_a_save_never_replaces_a_complete_checkpoint_this_fit_did_not_write(tmp_path, caplog):
    """checkpoint-2 written by another writer while this fit trains (a complete lightlike
    checkpoint) was replaced, and deleted, by this fit's save of step 2. It is moved aside and
    still verifies; this fit's own checkpoint-2 takes the name."""
    out = tmp_path / "run"

    class OtherWriter(ll.Callback):
        def on_step_end(self, fitter, state, control):
            if state.global_step == 2:
                with CheckpointWriter(out, 2) as w:
                    w.write_json("other.json", {"run": "other"})

    fit(out, [OtherWriter()])
    [aside] = [p for p in out.iterdir() if p.name.startswith("set-aside-")]
    assert verify_checkpoint(aside / "checkpoint-2")["files"].keys() == {"other.json"}
    assert "a complete checkpoint that this fit did not write" in caplog.text
    assert (out / "checkpoint-2" / "model.safetensors").is_file()
    verify_checkpoint(out / "checkpoint-2")


def test_overwrite_output_dir_removes_only_what_lightlike_wrote(tmp_path, caplog):
    """overwrite_output_dir=True deleted the whole logs/ folder, a user's notes with it. Now it
    removes lightlike's checkpoints and its loggers' files only: logs/my_notes.txt stays, bytes
    unchanged; another tool's checkpoint-9/ is moved aside; the old run's checkpoint-3 and
    metrics.csv rows are gone."""
    out = tmp_path / "run"
    fit(out, max_steps=3, save_every=3, loggers=["csv"])
    notes = out / "logs" / "my_notes.txt"
    notes.write_bytes(b"lr 1e-3 diverged at step 900\n")
    (out / "checkpoint-9").mkdir()
    (out / "checkpoint-9" / "pytorch_model.bin").write_bytes(b"foreign")
    fit(out, loggers=["csv"], overwrite_output_dir=True)
    assert notes.read_bytes() == b"lr 1e-3 diverged at step 900\n"
    assert "kept my_notes.txt" in caplog.text
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]
    steps = {line.split(",")[0] for line in (out / "logs" / "metrics.csv").read_text().splitlines()[1:]}
    assert steps == {"2"}  # the first run's step 3 row went with its file
    [aside] = [p for p in out.iterdir() if p.name.startswith("set-aside-")]
    assert (aside / "checkpoint-9" / "pytorch_model.bin").read_bytes() == b"foreign"


@pytest.mark.parametrize("link", ["checkpoint-1", "checkpoint-2", "logs"])
def test_a_symlink_in_output_dir_is_never_followed_to_delete(tmp_path, link):
    """``out/checkpoint-1`` (or the step this fit saves, or ``logs/``) a symbolic link to another
    run's: ``overwrite_output_dir=True`` deleted the other run's manifest, then failed on rmtree
    of the link. Nothing the link leads to is written or deleted; the link is not a checkpoint of
    this run, and is moved aside where this fit saves its own step."""
    other = tmp_path / "other"
    fit(other, loggers=["csv"])
    before = {p.relative_to(other): p.read_bytes() for p in other.rglob("*") if p.is_file() and p.name != ".lock"}
    out = tmp_path / "run"
    out.mkdir()
    target = other / ("logs" if link == "logs" else "checkpoint-2")
    (out / link).symlink_to(target, target_is_directory=True)
    fit(out, loggers=["csv"] if link != "logs" else [], overwrite_output_dir=True)
    after = {p.relative_to(other): p.read_bytes() for p in other.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before
    verify_checkpoint(other / "checkpoint-2")
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]
    assert not (out / "checkpoint-2").is_symlink()
    asides = [p / link for p in out.iterdir() if p.name.startswith("set-aside-")]
    if link == "checkpoint-2":  # in the way of this fit's save: moved aside, as a link
        assert [p.resolve() for p in asides if p.is_symlink()] == [target.resolve()]
    else:  # not counted as a checkpoint, not in the way: left where it is
        assert (out / link).is_symlink() and not asides


def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused_not_read(tmp_path):
    """A re-sealed manifest whose entry is ``../../secret``: refused by name before any file is
    read (its size or contents would otherwise be checked, and a loader could open it)."""
    import json

    out = tmp_path / "run"
    fit(out)
    ckpt = out / "checkpoint-2"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["../../secret"] = dict(manifest["files"]["rng.pt"])
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ll.CheckpointError, match=r"entry '\.\./\.\./secret' names a file outside the checkpoint"):
        verify_checkpoint(ckpt)


# ---- read-only paths ----------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["output_dir", "its parent"])
def test_a_read_only_output_dir_is_refused_at_set_up(tmp_path, where):
    """A read-only output_dir failed only at the first save, after training (a raw
    PermissionError). Now set-up refuses it with one error naming the path; no step is taken."""
    out = tmp_path / "parent" / "run"
    out.mkdir(parents=True) if where == "output_dir" else out.parent.mkdir()
    steps = []

    class Count(ll.Callback):
        def on_step_end(self, fitter, state, control):
            steps.append(state.global_step)

    with read_only(out if where == "output_dir" else out.parent):
        with pytest.raises(ll.ConfigError, match=f"output_dir {str(out)!r} cannot be written .*make it writable"):
            fit(out, [Count()])
    assert steps == []


def test_rotation_meeting_a_read_only_checkpoint_warns_and_goes_on(tmp_path, caplog):
    """save_total_limit=1 and an old checkpoint that cannot be deleted (made read-only after its
    save): the fit died with a raw PermissionError. It warns, naming the checkpoint, leaves it
    intact and trains on; the deletable ones are deleted."""
    out = tmp_path / "run"
    stack = contextlib.ExitStack()

    class Protect(ll.Callback):
        def on_save(self, fitter, state, control, path):
            if state.global_step == 1:
                stack.enter_context(read_only(path))

    with stack:
        result = fit(out, [Protect()], max_steps=3, save_every=1, save_total_limit=1)
        assert result.global_step == 3
        assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-3"]
        verify_checkpoint(out / "checkpoint-1")
    assert f"could not delete the old checkpoint {out / 'checkpoint-1'}" in caplog.text
    assert "left it as it was, and training goes on" in caplog.text


# ---- file modes ---------------------------------------------------------------------------------
def test_every_file_of_a_checkpoint_has_the_mode_open_gives(tmp_path):
    """model.safetensors was written 0o600 (safetensors' own choice), the other files 0o644. Every
    file of a checkpoint now has the mode open() gives a new file: 0o666 less the umask."""
    old = os.umask(0o002)
    try:
        fit(tmp_path / "run")
    finally:
        os.umask(old)
    ckpt = tmp_path / "run" / "checkpoint-2"
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in ckpt.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o666 & ~0o002)}, modes


# ---- running out of room while saving -------------------------------------------------------------
LIMITED = """
import resource, signal
out, limit = sys.argv[1], int(sys.argv[2])

class Limit(ll.Callback):
    def on_save(self, fitter, state, control, path):
        if state.global_step == 1:  # checkpoint-1 is saved: from here files may not grow past `limit`
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

ll.Fitter(output_dir=out, max_steps=2, save_every=1, batch_size=4, loggers=[], progress_bar=False,
          model_summary=False, callbacks=[Limit()]).fit(Classifier(width=64), DictDataset(n=16))
"""


@pytest.mark.parametrize("limit, first_too_large", [(5000, "optimizer.pt"), (1000, "model.safetensors")])
def test_a_file_size_limit_while_saving_is_one_error_and_the_earlier_checkpoint_stays(tmp_path, limit,
                                                                                      first_too_large):
    """A file-size limit (RLIMIT_FSIZE) met while saving checkpoint-2: the last line was torch's
    "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos ..." (optimizer.pt)
    or safetensors' "Error while serializing" (model.safetensors), the EFBIG only in the chain or
    the text. Now one CheckpointError says which checkpoint, why and what to do; checkpoint-1
    still verifies and no temp folder is left. (The model's weights take ~3.4 kB, its optimizer
    state ~7 kB: 5000 bytes stop optimizer.pt, 1000 bytes model.safetensors.)"""
    out = tmp_path / "run"
    p = run_killing_group([sys.executable, str(script(tmp_path, LIMITED)), str(out), str(limit)], timeout=300)
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("lightlike.errors.CheckpointError: checkpoint-2 not saved: file too large: a file-size "
                           f"limit (RLIMIT_FSIZE, `ulimit -f`: {limit / 1000:.1f} kB) stopped a write into {out} "
                           "(needed ~"), p.stderr[-3000:]
    assert "raise the limit (`ulimit -f unlimited`)" in last
    assert ("unexpected pos" if first_too_large == "optimizer.pt" else "os error 27") in p.stderr  # the cause, chained
    verify_checkpoint(out / "checkpoint-1")
    assert sorted(q.name for q in out.iterdir()) == ["checkpoint-1"]


FILLED = """
import errno, shutil
mount, copy_to = sys.argv[1], sys.argv[2]
out = os.path.join(mount, "run")

class Fill(ll.Callback):
    def on_save(self, fitter, state, control, path):
        if state.global_step == 1:  # checkpoint-1 is saved: now the file system fills up
            with open(os.path.join(mount, "filler"), "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"x" * 4096)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e

try:
    ll.Fitter(output_dir=out, max_steps=2, save_every=1, batch_size=4, loggers=[], progress_bar=False,
              model_summary=False, callbacks=[Fill()]).fit(Classifier(width=64), DictDataset(n=16))
finally:
    shutil.copytree(out, copy_to)  # what is left, out of the mount that ends with this process
"""


def test_a_full_disk_while_saving_is_one_error_and_the_earlier_checkpoint_stays(tmp_path):
    """A file system that fills up before checkpoint-2 (a 1 MB tmpfs, mounted in a mount namespace
    of the test's own that ends with its process): one CheckpointError naming the checkpoint,
    the path, what was needed and what is free; checkpoint-1 still verifies, no temp folder."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("no mount namespace here (unshare -m needs root): cannot mount a small file system")
    mount, copy = tmp_path / "mnt", tmp_path / "left"
    mount.mkdir()
    cmd = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$1" "$2" "$0" "$3"',
           str(mount), sys.executable, str(script(tmp_path, FILLED)), str(copy)]
    p = run_killing_group(cmd, timeout=300)
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("lightlike.errors.CheckpointError: checkpoint-2 not saved: no space left on the device "
                           f"at {mount / 'run'} (needed ~"), p.stderr[-3000:]
    assert " free); free some space (or lower save_total_limit)" in last
    verify_checkpoint(copy / "checkpoint-1")
    assert sorted(q.name for q in copy.iterdir()) == ["checkpoint-1"]
