"""Cluster environments and the launch recipes in strategies/."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_killing_group

from lightlike.errors import ConfigError
from lightlike.strategies import environment
from lightlike.strategies.environment import detect_environment, slurm_main_address, slurm_port

ROOT = Path(__file__).parents[2]
SCRIPT = Path(__file__).parents[1] / "scripts" / "ddp_target.py"
CLEAN = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC", "GROUP_RANK"))}


def test_detect_torchrun(monkeypatch):
    for k in list(os.environ):
        if k.startswith("SLURM_"):
            monkeypatch.delenv(k)
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234",
           "TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    e = detect_environment()
    assert (e.kind, e.rank, e.world_size, e.local_rank, e.node_rank, e.main_address, e.main_port) == \
        ("torchrun", 3, 8, 1, 1, "10.0.0.1", 1234)


def test_detect_slurm(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    env = {"SLURM_NTASKS": "64", "SLURM_PROCID": "17", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "gpu[003-010]", "SLURM_JOB_ID": "123456", "SLURM_JOB_NAME": "lightlike",
           "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "64"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the node list is parsed by hand
    e = detect_environment()
    assert (e.kind, e.rank, e.world_size, e.local_rank, e.node_rank) == ("slurm", 17, 64, 1, 2)
    assert e.main_address == "gpu003" and e.main_port == slurm_port("123456") == 15000 + 3456


def _slurm(monkeypatch, **env):
    """This process's environment made that of a SLURM job: nothing from the outer one, then ``env``."""
    for k in list(os.environ):
        if k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC", "GROUP_RANK")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol
    monkeypatch.setattr(environment, "_warned", set(), raising=False)
    base = {"SLURM_JOB_ID": "777", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "0", "SLURM_LOCALID": "0"}
    for k, v in {**base, **env}.items():
        monkeypatch.setenv(k, v)


# What each launch sets, as Slurm's sbatch/salloc/srun man pages describe it: the batch script
# (and an salloc shell) runs once, with SLURM_NTASKS and SLURM_PROCID=0 but no step id; srun
# starts SLURM_STEP_NUM_TASKS tasks, each with SLURM_STEP_ID and its own SLURM_PROCID.
BATCH = {"SLURM_JOB_NAME": "train", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
SRUN = {"SLURM_JOB_NAME": "train", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
        "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n2"}
INTERACTIVE = {"SLURM_JOB_NAME": "interactive", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
INTERACTIVE_SRUN = {**INTERACTIVE, "SLURM_PROCID": "1", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "2"}


def test_slurm_batch_step_without_srun_runs_one_process_and_says_so(monkeypatch, caplog):
    """`python train.py` straight in an sbatch script of 2 tasks: one process (not rank 0 of 2,
    waiting for a rank 1 nobody starts), with a warning to launch with srun."""
    _slurm(monkeypatch, **BATCH)
    with caplog.at_level("WARNING", logger="lightlike"):
        e = detect_environment()
        detect_environment()
    assert (e.kind, e.rank, e.world_size) == ("single", 0, 1)
    warnings = [r.getMessage() for r in caplog.records if "srun" in r.getMessage()]
    assert len(warnings) == 1 and "SLURM_NTASKS=2" in warnings[0] and "launch with `srun" in warnings[0]
    assert "use the 2 tasks" in warnings[0]


@pytest.mark.parametrize("step", ["batch", "extern", "interactive", "4294967294", "4294967291"])
def test_slurm_special_steps_are_not_srun(monkeypatch, step):
    _slurm(monkeypatch, **BATCH, SLURM_STEP_ID=step)
    assert detect_environment().world_size == 1


def test_slurm_srun_step(monkeypatch):
    _slurm(monkeypatch, **SRUN)
    e = detect_environment()
    assert (e.kind, e.rank, e.world_size, e.local_rank, e.main_address) == ("slurm", 1, 2, 1, "n2")


def test_slurm_world_size_is_the_steps_task_count(monkeypatch):
    """An allocation of 8 tasks, `srun -n 2` inside it: a world of 2, not 8; older Slurm spells
    the step id SLURM_STEPID; a step of one task is one process."""
    _slurm(monkeypatch, **{**SRUN, "SLURM_NTASKS": "8"})
    assert detect_environment().world_size == 2
    _slurm(monkeypatch, **{k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}, SLURM_STEPID="5")
    assert detect_environment().world_size == 2
    _slurm(monkeypatch, **{**SRUN, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"})
    assert detect_environment().kind == "single"


def test_slurm_srun_inside_interactive_allocation(monkeypatch):
    """srun tasks in an salloc / interactive allocation are one job of 2, not 2 single runs
    writing the same output_dir."""
    _slurm(monkeypatch, **INTERACTIVE_SRUN)
    e = detect_environment()
    assert (e.kind, e.rank, e.world_size) == ("slurm", 1, 2)


def test_slurm_interactive_without_srun(monkeypatch, caplog):
    _slurm(monkeypatch, **INTERACTIVE)
    with caplog.at_level("WARNING", logger="lightlike"):
        e = detect_environment()
    assert (e.kind, e.world_size) == ("single", 1)
    assert any("launch with `srun" in r.getMessage() for r in caplog.records)


def test_slurm_inconsistent_step(monkeypatch):
    _slurm(monkeypatch, **{**SRUN, "SLURM_PROCID": "2"})
    with pytest.raises(ConfigError, match="SLURM_PROCID=2 but SLURM_STEP_NUM_TASKS=2"):
        detect_environment()


@pytest.mark.parametrize("env, match", [
    ({"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"RANK=3 but WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_RANK": "0"}, r"RANK=0 but WORLD_SIZE=0"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "abc"}, r"MASTER_PORT='abc' is not an integer"),
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"RANK is not set"),
])
def test_inconsistent_torchrun_variables_are_clear_errors(monkeypatch, env, match):
    """RANK outside WORLD_SIZE used to wait for the process group timeout; the others were raw
    ValueError / KeyError."""
    _slurm(monkeypatch)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=match):
        detect_environment()


def test_world_size_without_ranks_is_an_error(monkeypatch):
    _slurm(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="WORLD_SIZE=4 is set but RANK and LOCAL_RANK are not.*torchrun"):
        detect_environment()
    monkeypatch.setenv("WORLD_SIZE", "1")  # says nothing new: one process
    assert detect_environment().kind == "single"


@pytest.mark.parametrize("env", [{"RANK": "1"}, {"RANK": "0", "LOCAL_RANK": "0"}, {"LOCAL_RANK": "1"}])
def test_rank_without_world_size_is_an_error(monkeypatch, env):
    """Two processes started with RANK=0 and RANK=1 but no WORLD_SIZE each ran a whole
    single-process fit, writing the same checkpoints over each other."""
    _slurm(monkeypatch)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="is set but WORLD_SIZE is not.*set WORLD_SIZE too"):
        detect_environment()
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")  # set by some tools on their own: says nothing
    assert detect_environment().kind == "single"


@pytest.mark.parametrize(("spec", "counts"), [("2(x2)", [2, 2]), ("3,2", [3, 2]), ("4(x2),1", [4, 4, 1]),
                                              ("8", [8]), ("", []), ("2(x", [])])
def test_slurm_tasks_per_node(spec, counts):
    assert environment.slurm_tasks_per_node(spec) == counts


def test_slurm_local_world_size_for_hsdp(monkeypatch):
    """srun sets no LOCAL_WORLD_SIZE, so hsdp's shard size (processes per node) fell back to the
    world size: 2 nodes x 2 tasks sharded over all 4 (mesh (1, 4)) instead of within each node
    (mesh (2, 2)). The step's task counts give it, and it is exported as torchrun would."""
    step = {"SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3",
            "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "n[1-2]"}
    _slurm(monkeypatch, **step, SLURM_STEP_TASKS_PER_NODE="2(x2)")
    e = detect_environment()
    assert (e.local_world_size, e.even_nodes) == (2, True)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(k, "")  # export() writes them: undone after the test (a later subprocess
    e.export()  # that inherited RANK and WORLD_SIZE waited for a rendezvous for ever)
    assert os.environ["LOCAL_WORLD_SIZE"] == "2"
    _slurm(monkeypatch, **step, SLURM_STEP_TASKS_PER_NODE="1,3")
    e = detect_environment()
    assert (e.local_world_size, e.even_nodes) == (3, False)  # node 1's count; hsdp refuses uneven nodes
    _slurm(monkeypatch, **step, SLURM_TASKS_PER_NODE="4(x2)")  # the job's counts are not this step's
    assert detect_environment().local_world_size is None
    _slurm(monkeypatch, **{**step, "SLURM_LOCALID": "2"}, SLURM_STEP_TASKS_PER_NODE="2(x2)")
    with pytest.raises(ConfigError, match="SLURM_LOCALID=2 but this node's task count is 2"):
        detect_environment()


def test_hsdp_refuses_nodes_it_cannot_count():
    from lightlike.strategies.environment import ClusterEnvironment
    from lightlike.strategies.fsdp import FSDPStrategy

    strategy = FSDPStrategy(hybrid=True)
    strategy.env = ClusterEnvironment("slurm", 0, 4, 0, 0, "h", 1, local_world_size=3, even_nodes=False)
    with pytest.raises(ConfigError, match="hsdp: the processes per node cannot be told.*shard_size"):
        strategy._hybrid_shape()
    strategy.env = ClusterEnvironment("slurm", 0, 4, 0, 0, "h", 1, local_world_size=2)
    assert strategy._hybrid_shape() == (2, 2)
    strategy.shard_size = 4  # said by the user: taken as it is
    strategy.env = ClusterEnvironment("slurm", 0, 4, 0, 0, "h", 1, local_world_size=None)
    assert strategy._hybrid_shape() == (1, 4)


def test_concurrent_srun_steps_of_one_job_rendezvous_apart(monkeypatch):
    """Two srun steps of one job side by side derived the same port, and their ranks joined each
    other's process groups (one step's rank 0 with the other's rank 1)."""
    ports = set()
    for step in ("0", "1", "2"):
        _slurm(monkeypatch, **{**SRUN, "SLURM_STEP_ID": step})
        ports.add(detect_environment().main_port)
    assert len(ports) == 3
    _slurm(monkeypatch, **SRUN, MASTER_PORT="abc")
    with pytest.raises(ConfigError, match="MASTER_PORT='abc' is not an integer"):
        detect_environment()


def test_single_process(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC")):
            monkeypatch.delenv(k)
    assert detect_environment().kind == "single"


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("a[01-04],b7", "a01"), ("x[5,9]", "x5"),
                                            ("h1,h2", "h1"), ("rack[1-2]-node[01-04]", "rack1-node01"),
                                            ("gpu-a[1-2],gpu-b3", "gpu-a1")])
def test_slurm_nodelist(monkeypatch, nodelist, first):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert slurm_main_address(nodelist) == first


RESTART_COMMON = ["--steps", "9", "--save-every", "2", "--items", "40"]


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    """strategies/torchrun.sh running the script on 2 processes, uninterrupted (RESTART_COMMON):
    the recipe's own test, and the reference of the restart test."""
    out = tmp_path_factory.mktemp("recipe") / "ref"
    env = {**CLEAN, "NPROC": "2", "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    cmd = ["bash", str(ROOT / "strategies" / "torchrun.sh"), str(SCRIPT), str(out), *RESTART_COMMON]
    return out, run_killing_group(cmd, env=env, timeout=240)


def test_torchrun_recipe_runs(recipe_run):
    out, p = recipe_run
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / "final-rank0.pt").exists() and (out / "final-rank1.pt").exists()


def test_torchrun_restart_resumes_from_the_newest_checkpoint(recipe_run, tmp_path):
    """The recipe's promise: with MAX_RESTARTS and resume='auto', a failure restarts the job and
    it continues from the newest checkpoint, ending with the uninterrupted run's weights. torchrun's
    agent keeps one store across attempts; the restarted attempt read the dead one's keys (gloo
    dialled old addresses: 'connectFullMesh failed' or a hang)."""
    env = {**CLEAN, "NPROC": "2", "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    common = RESTART_COMMON
    recipe = ["bash", str(ROOT / "strategies" / "torchrun.sh"), str(SCRIPT)]
    ref, p = recipe_run
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_killing_group([*recipe, str(tmp_path / "run"), *common, "--mode", "fail-once", "--fail-step", "5",
                           "--resume", "auto"], env={**env, "MAX_RESTARTS": "1"}, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "injected failure on rank 1, first attempt only" in p.stderr
    for rank in (0, 1):
        a = torch.load(tmp_path / "run" / f"final-rank{rank}.pt", weights_only=True)
        b = torch.load(ref / f"final-rank{rank}.pt", weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("recipe", ["slurm_single_node.sbatch", "slurm_multi_node.sbatch"])
def test_sbatch_recipe_under_simulated_slurm(tmp_path, recipe):
    """Read the recipe's directives and srun line, then start its tasks the way srun would: one
    process per task with SLURM_* set (2 tasks on this machine), and train for real over gloo."""
    text = (ROOT / "strategies" / recipe).read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))
    assert "requeue" in directives and directives["signal"].startswith("USR1@")
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--kill-on-bad-exit=1" in srun
    argv = shlex.split(srun.replace('"${TRAIN_SCRIPT:-train.py}"', str(SCRIPT)).replace('"$@"', ""))
    command = argv[argv.index("python3"):]
    command[0] = sys.executable
    procs = []
    for rank in range(2):
        env = {**CLEAN, "SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
               "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": str(40000 + os.getpid() % 9999),
               "SLURM_JOB_NAME": "lightlike", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}
        procs.append(subprocess.Popen([*command, str(tmp_path), "--steps", "3"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    w0 = torch.load(tmp_path / "final-rank0.pt", weights_only=True)
    w1 = torch.load(tmp_path / "final-rank1.pt", weights_only=True)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
