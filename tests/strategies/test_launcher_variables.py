"""Audit BO (round 12, mutation of the multi-process paths): single-process tests for edges the
torchrun tests leave open: launcher-variable boundaries, the node rank, srun's job-level task
counts, and a process group of another size already started."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from lightlike.errors import ConfigError
from lightlike.strategies import environment
from lightlike.strategies.environment import detect_environment

LAUNCH_VARS = ("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC",
               "GROUP_RANK")


def _env(monkeypatch, **env):
    for k in list(os.environ):
        if k.startswith(LAUNCH_VARS):
            monkeypatch.delenv(k)
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol
    monkeypatch.setattr(environment, "_warned", set())
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_the_node_rank_is_torchruns_group_rank_not_the_local_rank(monkeypatch):
    _env(monkeypatch, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", GROUP_RANK="1",
         TORCHELASTIC_RUN_ID="x")
    e = detect_environment()
    assert (e.rank, e.world_size, e.local_rank, e.node_rank, e.local_world_size) == (5, 8, 1, 1, 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert detect_environment().node_rank == 1
    monkeypatch.delenv("GROUP_RANK")  # a launcher that sets none: node 0
    assert detect_environment().node_rank == 0


def test_srun_local_world_size_from_the_jobs_counts_when_the_step_has_none(monkeypatch):
    """A Slurm that sets no SLURM_STEP_TASKS_PER_NODE: the job's SLURM_TASKS_PER_NODE gives this
    node's task count when it adds up to the step's tasks."""
    _env(monkeypatch, SLURM_JOB_ID="777", SLURM_JOB_NODELIST="n[1-2]", SLURM_STEP_ID="0",
         SLURM_STEP_NUM_TASKS="4", SLURM_NTASKS="4", SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NODEID="1",
         SLURM_TASKS_PER_NODE="2(x2)")
    e = detect_environment()
    assert (e.kind, e.rank, e.world_size, e.local_rank, e.node_rank, e.local_world_size, e.even_nodes) == \
        ("slurm", 3, 4, 1, 1, 2, True)
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1,3")  # uneven nodes: node 1's count
    e = detect_environment()
    assert (e.local_world_size, e.even_nodes) == (3, False)


def test_a_process_group_of_another_size_is_refused(monkeypatch):
    """A process group already started (by the user) whose size is not the launcher's WORLD_SIZE."""
    from lightlike.strategies.ddp import DDPStrategy

    _env(monkeypatch, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="44201")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # export() writes it: undone after the test
    ours = not dist.is_initialized()  # (an earlier single-process DDP fit in this session may have left one)
    if ours:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.get_world_size() == 1
        strategy = DDPStrategy(accelerator="cpu")
        with pytest.raises(ConfigError, match="a process group of 1 already exists but the environment says "
                                              "WORLD_SIZE=2"):
            strategy.setup_environment()
        assert not strategy._owns_group
    finally:
        if ours:
            dist.destroy_process_group()


class _Ranks:
    """A stand-in for a two-process strategy that records what failing_fast tells its collectives
    (itself here)."""

    global_rank, world_size, is_global_zero = 1, 2, False

    def __init__(self):
        self.failures = 0
        self.collectives = self

    def note_failure(self, report=None, call=0):
        self.failures += 1

    def failed_peers(self, call=0):
        return []


class _Fitter:
    def __init__(self, strategy, phase="train step", step=6):
        from types import SimpleNamespace

        self.strategy, self.phase = strategy, phase
        self.state, self.control = SimpleNamespace(global_step=step), None
        self.seen = []
        self.callbacks = SimpleNamespace(call=lambda event, fitter, state, control, error: self.seen.append(
            (event, type(error).__name__)))


@pytest.mark.parametrize("make, failure", [
    (lambda: RuntimeError("boom"), True),
    (lambda: __import__("lightlike.preemption").preemption.Preempted("SIGTERM", "out/checkpoint-6"), False),
    (lambda: __import__("lightlike.errors").errors.on_every_rank(ConfigError("agreed")), False),
])
def test_teardown_waits_for_peers_after_a_preemption_or_an_error_raised_on_every_rank(make, failure, caplog):
    """note_failure (teardown then skips its barrier) only for an error of this rank alone: a
    preemption or an error every rank raised at the same point leaves the ranks in step, and
    teardown must wait for them (a rank destroying gloo while a peer still talks aborts it)."""
    from lightlike.utils.failfast import failing_fast

    strategy = _Ranks()
    fitter = _Fitter(strategy)
    error = make()
    with pytest.raises(type(error)), failing_fast(fitter):
        raise error
    assert strategy.failures == int(failure)
    assert fitter.seen == [("on_exception", type(error).__name__)]
    lines = [r.getMessage() for r in caplog.records if "rank 1 of 2" in r.getMessage()]
    if isinstance(error, SystemExit):
        assert lines == []  # a preemption is no failure: no line
    else:
        assert lines == [f"rank 1 of 2 failed during train step at step 7: {type(error).__name__}: {error}"]


def test_ddp_collectives_pass_their_source_and_operation_through(monkeypatch):
    """broadcast_object sends from the rank asked for (evaluation in lockstep sends the stand-in
    batch from the lowest rank that has one, which is not rank 0 for a dataset that shards itself);
    all_reduce maps each op name to torch's op. Recorded, not run: one process cannot tell."""
    from lightlike.strategies import collectives as collectives_module
    from lightlike.strategies.ddp import DDPStrategy
    from lightlike.strategies.environment import ClusterEnvironment

    seen = []

    def broadcast_object_list(box, src):
        seen.append(("broadcast", src))
        box[0] = f"from {src}"

    def all_reduce(t, op=dist.ReduceOp.SUM, async_op=False):
        seen.append(("all_reduce", op))

    monkeypatch.setattr(collectives_module.dist, "broadcast_object_list", broadcast_object_list)
    monkeypatch.setattr(collectives_module.dist, "all_reduce", all_reduce)
    strategy = DDPStrategy(accelerator="cpu")
    strategy.env = ClusterEnvironment("torchrun", 0, 2, 0, 0, "127.0.0.1", 44202, 2)
    assert strategy.collectives.broadcast_object("mine", src=1) == "from 1"
    assert strategy.collectives.broadcast_object("mine") == "from 0"
    import torch

    for name in ("sum", "max", "min"):
        strategy.collectives.all_reduce(torch.ones(1), name)
    strategy.collectives.reduce_flag(True)
    assert seen == [("broadcast", 1), ("broadcast", 0), ("all_reduce", dist.ReduceOp.SUM),
                    ("all_reduce", dist.ReduceOp.MAX), ("all_reduce", dist.ReduceOp.MIN),
                    ("all_reduce", dist.ReduceOp.MAX)]


@pytest.mark.parametrize("attempt", ["0", "3"])
def test_a_torchrun_attempt_keeps_its_keys_under_its_own_prefix(monkeypatch, attempt):
    """Under torchrun --max-restarts, the agent's store outlives an attempt: each attempt's process
    group keeps its keys under /lightlike/attempt_<TORCHELASTIC_RESTART_COUNT>, so a restarted
    attempt does not read the dead one's addresses."""
    from lightlike.strategies.ddp import DDPStrategy

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    _env(monkeypatch, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
         MASTER_PORT=str(server.port), TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=attempt)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    given = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # (whatever an earlier test left up)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: given.update(kw))
    DDPStrategy(accelerator="cpu").setup_environment()
    given["store"].set("key", "value")
    assert server.check([f"/lightlike/attempt_{attempt}/key"])  # (check does not wait for the key; get does)
    assert server.get(f"/lightlike/attempt_{attempt}/key") == b"value"
    assert not server.check([f"/lightlike/attempt_{int(attempt) + 1}/key"])
