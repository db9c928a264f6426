"""Slurm launching: env-var derivations (pure), the sbatch scripts' --dry-run, and a real
single-node Slurm that runs scripts/slurm/het_tp.sbatch on 2 CPU tasks.

The real-cluster test needs slurmctld, slurmd and munge (scripts/slurm/local_cluster.sh
install). Without them it is skipped, unless HETTP_REQUIRE_SLURM=1 (set by .ci/run), where it
fails instead."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from hettp.launch_env import SlurmEnvError, distributed_env, expand_nodelist, master_port
from tests.utils import ROOT

SLURM = os.path.join(ROOT, "scripts", "slurm")


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("a[1-2],login,b3", ["a1", "a2", "login", "b3"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ],
)
def test_node_lists_expand_like_scontrol(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist, message",
    [
        ("gpu[01-03", "unbalanced '\\['"),
        ("gpu]1", "unbalanced '\\]'"),
        ("gpu[3-1]", "descending"),
        ("gpu[a-b]", "bad range"),
        ("", "names no host"),
    ],
)
def test_bad_node_lists_are_named(nodelist, message):
    with pytest.raises(SlurmEnvError, match=message):
        expand_nodelist(nodelist)


def test_ranks_and_ports_from_slurm_variables():
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
    }
    assert distributed_env(env) == {
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(20000 + 123456 % 20000),
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
    }
    per_node = distributed_env(env, per_node=True)
    assert per_node["NNODES"] == "2" and per_node["NODE_RANK"] == "1"
    assert "RANK" not in per_node
    # array jobs ("123_4") use the parent id; an explicit MASTER_* wins
    assert master_port("123_4") == master_port(123) == 20123
    assert (
        distributed_env({**env, "MASTER_PORT": "29500", "MASTER_ADDR": "10.0.0.1"})["MASTER_ADDR"]
        == "10.0.0.1"
    )
    assert len({master_port(j) for j in range(1000, 1100)}) == 100  # jobs do not collide
    with pytest.raises(SlurmEnvError, match="SLURM_PROCID unset"):
        distributed_env({k: v for k, v in env.items() if k != "SLURM_PROCID"})
    with pytest.raises(SlurmEnvError, match="not below SLURM_NTASKS"):
        distributed_env({**env, "SLURM_PROCID": "8"})


def _dry(script, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full.update(
        {
            "SLURM_JOB_ID": "777",
            "SLURM_JOB_NODELIST": "cn[3-4]",
            "SLURM_NTASKS": "4",
            "SLURM_PROCID": "2",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "1",
            "HETTP_DIR": ROOT,
            **env,
        }
    )
    return subprocess.run(
        ["bash", os.path.join(SLURM, script), "--dry-run"],
        env=full,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_sbatch_dry_runs_print_the_resolved_commands():
    out = _dry("het_tp.sbatch", TP="2", POLICY="migrate", EMULATE="persistent:rank=1,factor=2")
    assert out.returncode == 0, out.stderr
    assert "srun --kill-on-bad-exit=1 bash" in out.stdout and "task.sh" in out.stdout
    for flag in (
        "--tensor-model-parallel-size 2",
        "--het-tp-policy migrate",
        "--het-tp-emulate persistent:rank=1\\,factor=2",
    ):
        assert flag in out.stdout, out.stdout
    for line in ("MASTER_ADDR=cn3", "MASTER_PORT=20777", "RANK=2", "WORLD_SIZE=4"):
        assert f"export {line}" in out.stdout
    assert "--exit-signal-handler" in out.stdout and "--save" not in out.stdout
    saving = _dry("het_tp.sbatch", SAVE="/tmp/hettp-ckpt")
    assert "--exit-signal-handler --save /tmp/hettp-ckpt --load /tmp/hettp-ckpt" in saving.stdout
    for script in ("het_tp.sbatch", "het_tp_torchrun.sbatch", "vanilla.sbatch"):
        with open(os.path.join(SLURM, script)) as f:  # SIGTERM 2 minutes before the limit
            assert "#SBATCH --signal=TERM@120\n" in f.read(), script
    vanilla = _dry("vanilla.sbatch")
    assert vanilla.returncode == 0 and "--het-tp" not in vanilla.stdout
    # the baseline of a slowed het_tp.sbatch run is slowed alike (it ran unslowed, silently)
    slowed = _dry("vanilla.sbatch", EMULATE="persistent:rank=1,factor=2")
    assert slowed.returncode == 0, slowed.stderr
    assert "--het-tp-policy static --het-tp-emulate persistent:rank=1\\,factor=2" in slowed.stdout
    torchrun = _dry("het_tp_torchrun.sbatch", GPUS_PER_NODE="4")
    assert torchrun.returncode == 0, torchrun.stderr
    assert "torch.distributed.run" in torchrun.stdout
    assert "export NNODES=2" in torchrun.stdout and "export NODE_RANK=1" in torchrun.stdout
    compare = _dry(
        "compare.sbatch",
        ROUNDS="2",
        POLICY="hybrid",
        EMULATE="persistent:rank=1,factor=2",
        OUT="/tmp/hettp-dry-compare",
        SLURM_NTASKS="2",
        SLURM_PROCID="0",
    )
    assert compare.returncode == 0, compare.stderr
    # rounds x scenarios x {vanilla, none (timed), POLICY}: every run compare.py reports on
    assert compare.stdout.count("+ srun") == 2 * 2 * 3
    srun = [line for line in compare.stdout.splitlines() if line.startswith("+ srun")]
    plain = [line for line in srun if "emulated.vanilla." in line]
    assert len(plain) == 2 and all(
        "--het-tp-policy static --het-tp-emulate persistent:rank=1\\,factor=2" in line
        for line in plain
    )  # plain vanilla's layers, slowed as the others are
    assert "compare.py --report-only" in compare.stdout and "--repeats 2" in compare.stdout
    assert not os.path.exists("/tmp/hettp-dry-compare")  # a dry run writes nothing
    # two replicas: each ran one micro-batch a step (Megatron's default global batch), and the
    # report records that (compare.py's own default at --dp 2 is 4)
    replicas = _dry("compare.sbatch", OUT="/tmp/hettp-dry-compare", SLURM_NTASKS="4")
    assert replicas.returncode == 0, replicas.stderr
    assert "--dp 2 --microbatches 1 " in replicas.stdout
    assert "--global-batch-size" not in replicas.stdout
    # outside an allocation a dry run prints the commands all the same
    outside = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for script in ("het_tp.sbatch", "het_tp_torchrun.sbatch"):
        out = subprocess.run(
            ["bash", os.path.join(SLURM, script), "--dry-run"],
            env=dict(outside, HETTP_DIR=ROOT, OUT="/tmp/hettp-dry"),
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert out.returncode == 0 and "+ srun" in out.stdout, (script, out.stderr)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"TP": "two"}, "TP must be a positive integer"),
        ({"ITERS": "0"}, "ITERS must be"),
        ({"ROUNDS": "x"}, "ROUNDS must be"),
    ],
)
def test_sbatch_knobs_are_validated(env, message):
    out = _dry("compare.sbatch", OUT="/tmp/hettp-dry-compare", **env)
    assert out.returncode == 2 and message in out.stderr


def test_sbatch_refuses_unknown_arguments():
    out = subprocess.run(
        ["bash", os.path.join(SLURM, "het_tp.sbatch"), "--dryrun"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "unknown argument '--dryrun'" in out.stderr


@pytest.fixture(scope="module")  # one cluster for the module's jobs: it takes seconds to start
def cluster():
    missing = [t for t in ("slurmctld", "slurmd", "sbatch", "munged") if not shutil.which(t)]
    if missing:
        if os.environ.get("HETTP_REQUIRE_SLURM") == "1":
            pytest.fail(
                f"HETTP_REQUIRE_SLURM=1 but {', '.join(missing)} not installed "
                "(scripts/slurm/local_cluster.sh install)"
            )
        pytest.skip(f"no Slurm here ({', '.join(missing)} missing)")
    # munged wants every directory above its socket traversable by all: not pytest's tmp_path
    lab = Path(tempfile.mkdtemp(prefix="hettp-slurm-", dir="/tmp"))
    lab.chmod(0o711)
    env = dict(os.environ, SLURM_LAB=str(lab))
    script = os.path.join(SLURM, "local_cluster.sh")
    up = subprocess.run(
        ["bash", script, "up"], env=env, capture_output=True, text=True, timeout=120
    )
    try:
        assert up.returncode == 0, up.stderr
        env["SLURM_CONF"] = str(lab / "slurm.conf")
        yield env
    finally:
        subprocess.run(["bash", script, "down"], env=env, capture_output=True, timeout=120)
        left = [
            p for p in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid") if (lab / p).exists()
        ]
        shutil.rmtree(lab, ignore_errors=True)
        assert not left, f"{left} left running"


def _sbatch(cluster, tmp_path, script, **knobs) -> str:
    """Submit `script` on 2 tasks at TP=2 with migrate and `knobs` (common.sh's), output in
    `tmp_path`/out; wait for it to leave the queue; its output."""
    env = dict(
        cluster, HETTP_DIR=ROOT, TP="2", POLICY="migrate", OUT=str(tmp_path / "out"), **knobs
    )
    sub = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--ntasks-per-node=2",
            f"--output={tmp_path}/job-%j.out",
            os.path.join(SLURM, script),
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        queue = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True
        ).stdout.strip()
        if not queue:
            break
        time.sleep(1)
    else:
        pytest.fail(f"job {job} still queued/running after 600 s")
    return (tmp_path / f"job-{job}.out").read_text()


def test_het_tp_sbatch_runs_on_a_real_slurm(cluster, tmp_path):
    out = tmp_path / "out"
    log = _sbatch(
        cluster,
        tmp_path,
        "het_tp.sbatch",
        ITERS="20",
        INTERVAL="5",
        EMULATE="persistent:rank=1,factor=3",
    )
    assert "task 0 of 2" in log and "task 1 of 2" in log, log[-3000:]
    assert "iteration       20/      20" in log, log[-3000:]
    assert log.count(" iteration ") >= 4  # every --log-interval 5
    assert "het-TP decision at iteration" in log and ": migrate" in log, log[-3000:]
    assert (out / "het_tp.jsonl").exists()


def test_compare_sbatch_reports_on_a_real_slurm(cluster, tmp_path):
    """Every run compare.py's report reads, launched by Slurm, then the report itself. Without
    EMULATE (the cluster's own stragglers), the no-straggler runs alone: the emulated ones
    are the same runs with one more flag (the dry run shows it), and an emulated straggler
    under Slurm is the het_tp.sbatch test's."""
    out = tmp_path / "out"
    log = _sbatch(cluster, tmp_path, "compare.sbatch", ITERS="6", INTERVAL="2", ROUNDS="1")
    report = out / "report.md"
    assert report.exists(), log[-3000:]
    rows = [line for line in report.read_text().splitlines() if line.startswith("| ")]
    for policy in ("vanilla", "none", "migrate"):
        assert any(line.startswith(f"| none | {policy} |") for line in rows), rows
