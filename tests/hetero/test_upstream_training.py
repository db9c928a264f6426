"""Upstream Megatron-LM's own pretrain_gpt.py, trained for real on 2 CPU ranks through
scripts/upstream_cpu.py: unpatched (the reference), and patched with het-TP (a migration under an
emulated straggler from the even plan, with checkpoints; a resize), and the migrated run's last
checkpoint resumed by vanilla upstream and by het-TP. CI extracts the tree (HETTP_MEGATRON_LM)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.utils import ROOT, fresh_megatron_lm

LAUNCHER = os.path.join(ROOT, "scripts", "upstream_cpu.py")

pytestmark = pytest.mark.skipif(
    not os.environ.get("HETTP_MEGATRON_LM"),
    reason="set HETTP_MEGATRON_LM to a Megatron-LM checkout at core_v0.16.1 "
    "(CI extracts ../shared/upstream's)",
)

# A tiny GPT with upstream's own flags; the fusions are CUDA kernels, dropout 0 for exact
# comparisons, and a fixed decay length so a resumed run keeps the same schedule. One query
# group per TP rank: the het-TP runs use query heads as attention units (HEADS), whose query
# and key norms (--qk-layernorm) upstream's vanilla builds from its own spec.
MODEL = (
    "--tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
    "--group-query-attention --num-query-groups 2 --qk-layernorm "
    "--seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 2 "
    "--lr 1e-3 --lr-decay-iters 14 --mock-data --tokenizer-type NullTokenizer --vocab-size 255 "
    "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-interval 100 "
    "--eval-iters 1 --transformer-impl local --no-persist-layer-norm "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion "
    "--no-bias-dropout-fusion"
).split()
STRAGGLER = ["--het-tp-emulate", "persistent:rank=1,factor=3", "--het-tp-interval", "2"]
HEADS = ["--het-tp-attn-granularity", "1"]
# the weight-decay schedule's length follows --train-iters, which a resumed run extends
RESUME = ["--override-opt_param-scheduler"]
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
FAILURE = re.compile(r"error|exception|terminate|what\(\)|abort|traceback|signal", re.I)
VALIDATION = re.compile(
    r"validation loss at iteration (\d+) on validation set \| lm loss value: ([0-9.E+-]+)"
)


@dataclass
class Run:
    returncode: int
    output: str

    @property
    def losses(self) -> dict[int, float]:
        return {int(i): float(v) for i, v in ITERATION.findall(self.output)}

    @property
    def validation(self) -> dict[int, float]:
        return {int(i): float(v) for i, v in VALIDATION.findall(self.output)}

    def __str__(self):
        """What a failing assert shows (given as a str, which pytest does not shorten): the
        lines that name an error (a native abort's `terminate called ...` too), then the end
        of the output, warnings left out."""
        lines = [line for line in self.output.splitlines() if "warn" not in line.lower()]
        errors = [line for line in lines[:-40] if FAILURE.search(line)][-20:]
        return (
            f"Run(returncode={self.returncode}, errors:\n"
            + "\n".join(errors)
            + "\noutput ends:\n"
            + "\n".join(lines[-40:])
            + ")"
        )


def launch(tree: str, *flags: str, timeout: float = 420) -> Run:
    """torchrun --nproc_per_node 2 scripts/upstream_cpu.py TREE/pretrain_gpt.py MODEL FLAGS."""
    from tests.utils.ranks import _free_port

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        LAUNCHER,
        os.path.join(tree, "pretrain_gpt.py"),
        *MODEL,
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
    )
    return Run(out.returncode, out.stdout + out.stderr)


def _close(a: dict, b: dict, iterations) -> None:
    for it in iterations:
        assert a[it] == pytest.approx(b[it], rel=1e-5, abs=1e-6), it


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """(unpatched, patched) copies of the given tree; the datasets helper is built once, by
    the reference run in the unpatched one, and copied along."""
    base = tmp_path_factory.mktemp("upstream")
    fresh = fresh_megatron_lm(str(base / "fresh"))
    return fresh, str(base / "patched"), base


@pytest.fixture(scope="module")
def vanilla(trees):
    """Unpatched upstream, 12 iterations and a checkpoint: the reference."""
    fresh, patched, base = trees
    run = launch(
        fresh, "--train-iters", "12", "--save", str(base / "vanilla"), "--save-interval", "100"
    )
    assert run.returncode == 0, str(run)
    shutil.copytree(fresh, patched, symlinks=True)  # with the built helper
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "patches", "apply.sh"), patched],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    return run


@pytest.fixture(scope="module")
def vanilla_resumed(trees, vanilla):
    """Unpatched upstream resuming its own checkpoint to 14: the reference for resumes (on
    this data a resumed run is not bit-identical to an uninterrupted one, in upstream itself)."""
    fresh, _, base = trees
    run = launch(fresh, "--load", str(base / "vanilla"), "--train-iters", "14", *RESUME)
    assert run.returncode == 0, str(run)
    return run


@pytest.fixture(scope="module")
def migrated(trees, vanilla):
    """The issue's acceptance command: migrate under a 3x straggler, checkpoints every 5."""
    _, patched, base = trees
    save = str(base / "migrated")
    run = launch(
        patched,
        "--het-tp-policy",
        "migrate",
        *STRAGGLER,
        *HEADS,
        "--train-iters",
        "12",
        "--save",
        save,
        "--save-interval",
        "5",
        "--disable-gloo-process-groups",  # a migration's optimizer rebuild must do without
    )
    return run, save


def _copy_checkpoints(save: str, dest: str) -> str:
    shutil.copytree(save, dest)
    return dest


def test_vanilla_upstream_trains_and_resumes_on_cpu_ranks(vanilla, vanilla_resumed):
    assert sorted(vanilla.losses) == list(range(1, 13))
    assert vanilla.losses[12] < vanilla.losses[1]
    assert 12 in vanilla.validation
    assert sorted(vanilla_resumed.losses) == [13, 14]


def test_migration_under_a_straggler_is_lossless_and_leaves_a_checkpoint_at_12(migrated, vanilla):
    run, save = migrated
    assert run.returncode == 0, str(run)
    # het-TP layers in Megatron's even split until the straggler is acted on
    even = "het-TP plan at iteration 0 (initial): TP=2 layers 0-1: attn 2/2 mlp 128/128"
    assert even in run.output
    decision = re.search(r"het-TP decision at iteration (\d+): migrate", run.output)
    assert decision, str(run)
    assert f"het-TP repartition at iteration {decision.group(1)}" in run.output
    _close(run.losses, vanilla.losses, range(1, 13))
    assert sorted(run.losses) == list(range(1, 13))
    # the final save after train() (12 is not a multiple of 5) used the rebuilt model and
    # optimizer; it holds the migrated plan
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "12"
    assert "successfully saved checkpoint from iteration      12" in run.output
    assert 12 in run.validation  # pretrain()'s final evaluation, on the rebuilt model
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(os.path.join(save, "iter_0000012"))
    from megatron.hetero.runtime import SavedPlan

    plan = SavedPlan.from_dict(common["het_tp_plan"]).plan
    assert any(plan.counts(layer, "mlp") != (128, 128) for layer in range(2))
    assert common["iteration"] == 12


def test_vanilla_upstream_resumes_the_migrated_checkpoint(trees, vanilla_resumed, migrated):
    fresh, _, base = trees
    run, save = migrated
    assert run.returncode == 0, str(run)
    load = _copy_checkpoints(save, str(base / "vanilla_resume"))
    resumed = launch(fresh, "--load", load, "--train-iters", "14", *RESUME)
    assert resumed.returncode == 0, str(resumed)
    assert sorted(resumed.losses) == [13, 14]
    _close(resumed.losses, vanilla_resumed.losses, (13, 14))


def test_het_tp_resumes_in_the_migrated_plan(trees, vanilla_resumed, migrated):
    _, patched, base = trees
    run, save = migrated
    assert run.returncode == 0, str(run)
    load = _copy_checkpoints(save, str(base / "het_resume"))
    resumed = launch(
        patched,
        "--load",
        load,
        "--train-iters",
        "14",
        *RESUME,
        "--het-tp-policy",
        "migrate",
        "--het-tp-interval",
        "2",
        *HEADS,
    )
    assert resumed.returncode == 0, str(resumed)
    last_plan = re.findall(r"het-TP repartition at iteration \d+: (TP=2 .*?) \|", run.output)[-1]
    assert f"het-TP plan at iteration 12 (resumed from the checkpoint): {last_plan}" in (
        resumed.output
    )
    assert "not resumed" not in resumed.output  # the runtime's state came back too
    _close(resumed.losses, vanilla_resumed.losses, (13, 14))


def test_resize_under_a_straggler_decides_and_finishes(trees, vanilla):
    _, patched, _ = trees
    run = launch(patched, "--het-tp-policy", "resize", *STRAGGLER, *HEADS, "--train-iters", "8")
    assert run.returncode == 0, str(run)
    assert re.search(r"het-TP decision at iteration \d+: resize", run.output), str(run)
    assert sorted(run.losses) == list(range(1, 9))
    assert all(loss == loss and loss < 10 for loss in run.losses.values())


def test_unsupported_upstream_flags_are_refused_by_name(trees, vanilla):
    _, patched, _ = trees
    run = launch(patched, "--het-tp", "--train-iters", "2", "--ckpt-format", "torch")
    assert run.returncode != 0
    assert "het-TP: error: --ckpt-format torch: " in run.output
    assert "iteration        1/" not in run.output
