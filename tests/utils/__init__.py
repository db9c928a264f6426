"""What the tests share: rank spawning, the functions ranks run, model flags, paths.

Test modules import from here only, never from one another. Worker functions keep their home in
tests.utils.workers (the fork server preloads it; ranks unpickle them by that name)."""

from tests.utils import workers
from tests.utils.adam_moments import resume_misfit, resumed_misfits
from tests.utils.files import damage, make_corpus
from tests.utils.fused_adam import GroupStepAdam, using_group_step_adam
from tests.utils.jobs import Job, run_job
from tests.utils.models import BASE, COMMON, GEMM_BACKWARD, GQA, MHA, close
from tests.utils.paths import ROOT
from tests.utils.ranks import PRELOAD, run_ranks
from tests.utils.scripts import load_script
from tests.utils.upstream import PATCH, fresh_megatron_lm
from tests.utils.workers import (
    compat_paths,
    exchange_primitives,
    exchange_value,
    exit_watch,
    het_numerics,
    preloaded,
    train,
    train_and_count_whole_masters,
    train_and_read_norms,
    train_drawing_apart,
    train_pricing_a_layer_move,
    train_reading_the_tracker_apart,
    train_with_a_recording_wandb,
    train_with_control,
    train_with_data_split,
    train_with_failing_planner,
    train_with_failing_save,
    train_with_layer_moves,
    train_with_repartitions,
    train_with_resizes,
    train_with_slow_boundary,
    upstream_resume_paths,
)

__all__ = [
    "GEMM_BACKWARD",
    "GroupStepAdam",
    "BASE",
    "Job",
    "COMMON",
    "GQA",
    "MHA",
    "PATCH",
    "PRELOAD",
    "ROOT",
    "close",
    "compat_paths",
    "damage",
    "load_script",
    "exchange_primitives",
    "exchange_value",
    "exit_watch",
    "fresh_megatron_lm",
    "het_numerics",
    "make_corpus",
    "preloaded",
    "resume_misfit",
    "resumed_misfits",
    "run_job",
    "run_ranks",
    "train",
    "train_and_count_whole_masters",
    "train_with_a_recording_wandb",
    "train_drawing_apart",
    "train_pricing_a_layer_move",
    "train_reading_the_tracker_apart",
    "upstream_resume_paths",
    "train_and_read_norms",
    "train_with_control",
    "train_with_data_split",
    "train_with_layer_moves",
    "train_with_failing_planner",
    "train_with_failing_save",
    "train_with_repartitions",
    "train_with_resizes",
    "train_with_slow_boundary",
    "using_group_step_adam",
    "workers",
]
