"""Flags reach megatron-core's configs with Megatron-LM's meaning (no process group needed)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from megatron.hetero.arguments import ArgumentError, build_parser, validate_args
from megatron.hetero.data import build_tokenizer, dataset_config
from megatron.hetero.model import transformer_config
from megatron.hetero.training import optimizer_config, scheduler_kwargs
from tests.utils import make_corpus

BASE = (
    "--num-layers 3 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --train-iters 100 --lr 1e-3 --mock-data --vocab-size 255"
)


def _args(extra="", cuda=False, world_size=1):
    args = build_parser().parse_args((BASE + " " + extra).split())
    validate_args(args, world_size, cuda_available=cuda)
    return args


def test_model_flags_reach_transformer_config():
    args = _args(
        "--swiglu --disable-bias-linear --normalization RMSNorm --norm-epsilon 1e-6 "
        "--group-query-attention --num-query-groups 2 --kv-channels 32 "
        "--init-method-std 0.01 --hidden-dropout 0.2 --attention-dropout 0.3 "
        "--ffn-hidden-size 96 --tensor-model-parallel-size 2",
        world_size=2,
    )
    c = transformer_config(args)
    assert (c.num_layers, c.hidden_size, c.num_attention_heads) == (3, 64, 4)
    assert c.num_query_groups == 2 and c.kv_channels == 32 and c.ffn_hidden_size == 96
    assert c.gated_linear_unit and c.activation_func is F.silu and not c.add_bias_linear
    assert c.normalization == "RMSNorm" and c.layernorm_epsilon == 1e-6
    assert c.init_method_std == 0.01 and c.hidden_dropout == 0.2 and c.attention_dropout == 0.3
    assert c.tensor_model_parallel_size == 2 and not c.sequence_parallel
    assert c.use_cpu_initialization and c.params_dtype == torch.float32
    default = transformer_config(_args())
    assert default.activation_func is F.gelu and default.add_bias_linear
    assert default.normalization == "LayerNorm"


def test_precision_flags_on_gpu():
    c = transformer_config(_args("--bf16", cuda=True))
    assert c.bf16 and not c.fp16 and c.params_dtype == torch.bfloat16
    o = optimizer_config(_args("--fp16 --loss-scale 128 --initial-loss-scale 1024", cuda=True))
    assert o.fp16 and o.loss_scale == 128 and o.initial_loss_scale == 1024
    assert o.params_dtype == torch.float16


def test_optimizer_flags_reach_optimizer_config():
    o = optimizer_config(
        _args(
            "--weight-decay 0.1 --adam-beta1 0.8 --adam-beta2 0.95 "
            "--adam-eps 1e-6 --clip-grad 0.5 --min-lr 1e-5"
        )
    )
    assert o.optimizer == "adam" and o.lr == 1e-3 and o.min_lr == 1e-5
    assert (o.weight_decay, o.adam_beta1, o.adam_beta2, o.adam_eps) == (0.1, 0.8, 0.95, 1e-6)
    assert o.clip_grad == 0.5 and not o.use_distributed_optimizer
    sgd = optimizer_config(_args("--optimizer sgd --sgd-momentum 0.5"))
    assert sgd.optimizer == "sgd" and sgd.sgd_momentum == 0.5


def test_qwen_and_llama3_model_flags_reach_the_config_and_the_model(monkeypatch):
    import megatron.hetero.model as model

    args = _args(
        "--disable-bias-linear --add-qkv-bias --squared-relu --position-embedding-type rope "
        "--rotary-interleaved --rotary-seq-len-interpolation-factor 4 --use-rope-scaling "
        "--rope-scaling-factor 16"
    )
    c = transformer_config(args)
    assert c.add_qkv_bias and not c.add_bias_linear and c.activation_func is model.squared_relu
    x = torch.tensor([-1.0, 0.5, 2.0])
    assert torch.equal(model.squared_relu(x), torch.tensor([0.0, 0.25, 4.0]))
    assert c.rotary_interleaved
    assert transformer_config(_args()).add_qkv_bias  # biases on every linear: the QKV's too
    built = {}
    monkeypatch.setattr(model, "GPTModel", lambda **kw: built.update(kw))
    monkeypatch.setattr(model, "get_num_layers_to_build", lambda config: config.num_layers)
    monkeypatch.setattr(model.parallel_state, "is_pipeline_first_stage", lambda: True)
    monkeypatch.setattr(model.parallel_state, "is_pipeline_last_stage", lambda: True)
    model.build_gpt_model(args, c, 255)
    assert built["rope_scaling"] and built["rope_scaling_factor"] == 16.0
    assert built["seq_len_interpolation_factor"] == 4


@pytest.mark.parametrize(
    "extra,message",
    [
        ("--squared-relu --swiglu", "--squared-relu and --swiglu are two activations"),
        ("--use-rope-scaling", "--use-rope-scaling applies to --position-embedding-type rope"),
        ("--rotary-interleaved", "--rotary-interleaved applies to --position-embedding-type"),
        (
            "--position-embedding-type rope --rotary-seq-len-interpolation-factor 0",
            "--rotary-seq-len-interpolation-factor must be positive, got 0",
        ),
        (
            "--position-embedding-type rope --rope-scaling-factor 4",
            "--rope-scaling-factor applies with --use-rope-scaling",
        ),
    ],
)
def test_model_flag_errors_name_the_flags(extra, message):
    with pytest.raises(ArgumentError, match=message):
        _args(extra)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_lr_schedule_matches_megatron_scheduler(style):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    args = _args(
        f"--lr-decay-style {style} --lr-warmup-iters 10 --lr-warmup-init 1e-4 "
        "--min-lr 1e-5 --lr-decay-iters 50"
    )
    kw = scheduler_kwargs(args)
    gbs = args.global_batch_size  # the scheduler counts samples, as Megatron-LM's
    assert kw["lr_warmup_steps"] == 10 * gbs and kw["lr_decay_steps"] == 50 * gbs
    assert kw["init_lr"] == 1e-4 and kw["lr_decay_style"] == style

    class _Opt:  # the scheduler only touches param_groups
        param_groups = [{"lr": 0.0, "weight_decay": 0.0}]

    sched = OptimizerParamScheduler(_Opt(), **kw)
    lrs = []
    for _ in range(60):
        lrs.append(_Opt.param_groups[0]["lr"])
        sched.step(gbs)
    assert lrs[0] == pytest.approx(1e-4) and lrs[10] == pytest.approx(1e-3)
    if style == "constant":
        assert lrs[-1] == pytest.approx(1e-3)
    elif style in ("linear", "cosine"):
        assert lrs[50] == pytest.approx(1e-5) and lrs[-1] == pytest.approx(1e-5)
    else:  # max_lr * sqrt(warmup / step) until the decay horizon
        assert lrs[30] == pytest.approx(1e-3 * (10 / 30) ** 0.5)


def _rates(kw, steps, gbs):
    """(lr, weight decay) of megatron-core's scheduler built from `kw`, before each step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class _Opt:
        param_groups = [{"lr": 0.0, "weight_decay": 0.0}]

    sched = OptimizerParamScheduler(_Opt(), **kw)
    out = []
    for _ in range(steps):
        out.append((_Opt.param_groups[0]["lr"], _Opt.param_groups[0]["weight_decay"]))
        sched.step(gbs)
    return out


@pytest.mark.parametrize("unit", ["iters", "samples"])
def test_wsd_and_a_weight_decay_ramp_are_megatrons(unit):
    """WSD: warm-up, the peak rate held, then the last --lr-wsd-decay-iters (or -samples) down
    to --min-lr; the weight decay from --start- to --end-weight-decay over the run."""
    length = "--train-iters 100" if unit == "iters" else "--train-samples 200"
    wsd = "--lr-wsd-decay-iters 20" if unit == "iters" else "--lr-wsd-decay-samples 40"
    args = build_parser().parse_args(
        (
            BASE.replace("--train-iters 100", length)
            + f" --lr-decay-style WSD --lr-wsd-decay-style linear {wsd} --min-lr 1e-5"
            " --weight-decay-incr-style linear --start-weight-decay 0.0 --end-weight-decay 0.1"
        ).split()
    )
    validate_args(args, 1, cuda_available=False)
    gbs = args.global_batch_size
    kw = scheduler_kwargs(args)
    assert kw["wsd_decay_steps"] == 20 * gbs and kw["lr_wsd_decay_style"] == "linear"
    assert kw["wd_incr_style"] == "linear" and (kw["start_wd"], kw["end_wd"]) == (0.0, 0.1)
    rates = _rates(kw, 101, gbs)
    assert all(lr == pytest.approx(1e-3) for lr, _ in rates[1:81])  # stable
    # linear both ways (a cosine would read 0.854 and 0.146 of the way at the quarters)
    assert rates[85][0] == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.75)
    assert rates[90][0] == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5)
    assert rates[100][0] == pytest.approx(1e-5)
    assert [wd for _, wd in rates[::25]] == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1])


@pytest.mark.parametrize(
    "extra,message",
    [
        ("--lr-decay-style WSD", "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
        ("--lr-wsd-decay-iters 5", "--lr-wsd-decay-iters applies to --lr-decay-style WSD"),
        ("--lr-decay-style WSD --lr-wsd-decay-iters 101", "at most the decay's length"),
        ("--lr-decay-style WSD --lr-wsd-decay-samples 8", "--lr-wsd-decay-samples goes with"),
        ("--start-weight-decay 0.1", "go with --weight-decay-incr-style linear or cosine"),
        ("--weight-decay-incr-style cosine", "needs --start-weight-decay and --end-weight"),
        (
            "--weight-decay-incr-style linear --start-weight-decay -1 --end-weight-decay 0",
            "must be >= 0",
        ),
        (
            "--weight-decay-incr-style linear --start-weight-decay 0.1 --end-weight-decay 0",
            r"--end-weight-decay \(0.0\) must be at least --start-weight-decay \(0.1\)",
        ),
    ],
)
def test_schedule_shape_errors_name_the_flags(extra, message):
    with pytest.raises(ArgumentError, match=message):
        _args(extra)


def test_sample_based_schedules_are_megatrons():
    """--train-samples: iterations are samples / global batch, and the schedule counts the
    samples given; --lr-warmup-fraction takes that fraction of the decay."""
    args = build_parser().parse_args(
        (
            BASE.replace("--train-iters 100", "--train-samples 200")
            + " --lr-warmup-samples 40 --lr-decay-samples 160"
        ).split()
    )
    validate_args(args, 1, cuda_available=False)
    kw = scheduler_kwargs(args)
    assert args.train_iters == 200 // args.global_batch_size
    assert (kw["lr_warmup_steps"], kw["lr_decay_steps"], kw["wd_incr_steps"]) == (40, 160, 200)
    fraction = scheduler_kwargs(_args("--lr-warmup-fraction 0.1 --lr-decay-iters 50"))
    # 10% of 50 iterations x 2 samples
    assert fraction["lr_warmup_steps"] == pytest.approx(0.1 * 50 * 2)


def test_data_flags_reach_dataset_config(tmp_path):
    prefixes = []
    for name in ("a", "b"):  # validation reads the index headers: real (tiny) datasets
        (tmp_path / name).mkdir()
        prefixes.append(make_corpus(tmp_path / name, documents=10))
    args = _args(
        f"--eod-mask-loss --data-cache-path {tmp_path} --seed 7 "
        "--num-dataset-builder-threads 3 --mid-level-dataset-surplus 0.01"
    )
    cfg = dataset_config(args, build_tokenizer(args.tokenizer_type, args.vocab_size))
    assert cfg.eod_mask_loss and cfg.path_to_cache == str(tmp_path) and cfg.random_seed == 7
    assert cfg.num_dataset_builder_threads == 3 and cfg.mid_level_dataset_surplus == 0.01
    assert cfg.sequence_length == 32 and cfg.mock
    args = build_parser().parse_args(
        (
            BASE.replace("--mock-data --vocab-size 255", "")
            + f" --data-path 0.3 {prefixes[0]} 0.7 {prefixes[1]} --split 90,10,0"
            + " --tokenizer-type ByteLevelTokenizer"
        ).split()
    )
    validate_args(args, 1, cuda_available=False)
    cfg = dataset_config(args, build_tokenizer(args.tokenizer_type, args.vocab_size))
    assert cfg.blend == (prefixes, [0.3, 0.7])
    assert cfg.split == "90,10,0"
    assert args.tokenizer_type == "ByteLevelTokenizer"


def test_tensorboard_dir_needs_tensorboard(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(ArgumentError, match="--tensorboard-dir needs the tensorboard package"):
        _args(f"--tensorboard-dir {tmp_path}")


def test_wandb_flags_are_checked_at_start(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    for extra, message in [
        ("--wandb-project p", "--wandb-project needs --wandb-exp-name (the run's name)"),
        ("--wandb-project p --wandb-exp-name e", "--wandb-project needs --wandb-save-dir (or"),
        (
            f"--wandb-project p --wandb-exp-name e --save {tmp_path}",
            "--wandb-project needs the wandb package (pip install wandb)",
        ),
    ]:
        with pytest.raises(ArgumentError, match=re.escape(message)):
            _args(extra)
    _args("--wandb-exp-name e")  # nothing to log to without a project: as Megatron-LM, ignored


def test_megatron_lm_older_and_precision_flags_take_megatron_lm_meaning(monkeypatch):
    """Flags Megatron-LM's scripts carry: the older spellings of rope, query-key layer scaling,
    the dynamic loss scaler's settings, the gradient reduction dtype and the local rank."""
    from megatron.hetero.arguments import local_rank
    from megatron.hetero.training import ddp_config

    assert _args("--use-rotary-position-embeddings").position_embedding_type == "rope"
    args = _args("--position-embedding-type rope --no-position-embedding")
    assert args.position_embedding_type == "rope" and not args.add_position_embedding
    c = transformer_config(
        _args(
            "--apply-query-key-layer-scaling --attention-softmax-in-fp32 "
            "--embedding-init-method-std 0.5"
        )
    )
    assert c.apply_query_key_layer_scaling and c.embedding_init_method_std == 0.5
    assert transformer_config(_args()).embedding_init_method_std == 0.02  # --init-method-std's
    # the spellings Megatron-LM's parser generates for its on-by-default flags
    args = _args(
        "--manual-gc --disable-manual-gc-eval --disable-log-loss-scale-to-tensorboard "
        "--no-use-tokenizer-model-from-checkpoint-args"
    )
    assert not (args.manual_gc_eval or args.log_loss_scale_to_tensorboard)
    assert not args.use_tokenizer_model_from_checkpoint_args
    o = optimizer_config(
        _args(
            "--fp16 --min-loss-scale 4 --loss-scale-window 50 --hysteresis 3",
            cuda=True,
        )
    )
    assert (o.min_loss_scale, o.loss_scale_window, o.hysteresis) == (4, 50, 3)
    d = optimizer_config(_args("--fp16", cuda=True))
    assert (d.min_loss_scale, d.loss_scale_window, d.hysteresis) == (1.0, 1000, 2)
    # Megatron-LM's gradient dtypes: bf16 reduces in fp32 unless asked, fp16 only when asked
    for extra, fp32 in [
        ("--bf16", True),
        ("--bf16 --grad-reduce-in-bf16", False),
        ("--fp16", False),
        ("--fp16 --accumulate-allreduce-grads-in-fp32", True),
        ("", False),
    ]:
        assert ddp_config(_args(extra, cuda=True)).grad_reduce_in_fp32 == fp32, extra
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert local_rank(_args()) == 0 and local_rank(_args("--local-rank 3")) == 3
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert local_rank(_args()) == 2 and local_rank(_args("--local-rank 2")) == 2
    with pytest.raises(ArgumentError, match="--local-rank 1 disagrees with LOCAL_RANK=2"):
        _args("--local-rank 1")


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            "--no-position-embedding",
            "--no-position-embedding is Megatron-LM's older spelling for rope models: give "
            "--position-embedding-type (this run: learned_absolute)",
        ),
        (
            "--bf16 --grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32",
            "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 ask for two",
        ),
        ("--min-loss-scale 0", "--min-loss-scale must be positive, got 0.0"),
        ("--loss-scale-window -1", "--loss-scale-window must be positive, got -1.0"),
        ("--hysteresis 0", "--hysteresis must be >= 1, got 0"),
        ("--num-dataset-builder-threads 0", "--num-dataset-builder-threads must be positive"),
        ("--mid-level-dataset-surplus -1", "--mid-level-dataset-surplus must be >= 0, got -1.0"),
        ("--dataloader-type cyclic", "--dataloader-type cyclic: this trainer reads the samples"),
        (
            "--reset-attention-mask --no-create-attention-mask-in-dataloader",
            "--reset-attention-mask needs the dataloader's masks",
        ),
    ],
)
def test_megatron_lm_flags_with_values_it_cannot_honour_are_refused(extra, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        _args(extra, cuda="grad-reduce" in extra)


def test_documents_reset_positions_and_attention(tmp_path):
    """--reset-position-ids and --reset-attention-mask reach megatron-core's GPT dataset: in a
    sample that spans documents, each document starts at position 0 and attends to itself."""
    from megatron.hetero.data import build_datasets

    prefix = make_corpus(tmp_path, documents=10)  # 56 tokens a document, EOD last
    argv = (
        BASE.replace("--mock-data --vocab-size 255", "--tokenizer-type ByteLevelTokenizer")
        + f" --data-path {prefix} --split 100,0,0 --data-cache-path {tmp_path / 'cache'}"
    )
    samples = {}
    for extra in ("", " --reset-position-ids --reset-attention-mask"):
        args = build_parser().parse_args((argv + extra).split())
        validate_args(args, 1, cuda_available=False)
        train, _, _ = build_datasets(args, build_tokenizer(args.tokenizer_type, None))
        samples[extra] = [train[i] for i in range(len(train))]
    eod = build_tokenizer("ByteLevelTokenizer", None).eod
    spanning = 0
    for plain, reset in zip(*samples.values()):
        assert torch.equal(torch.as_tensor(plain["tokens"]), torch.as_tensor(reset["tokens"]))
        assert torch.equal(torch.as_tensor(plain["position_ids"]), torch.arange(32))
        tokens = torch.as_tensor(reset["tokens"])
        ends = (tokens[:-1] == eod).nonzero().flatten().tolist()
        spanning += bool(ends)
        starts = [0] + [e + 1 for e in ends]
        document = torch.zeros(32, dtype=torch.long)
        for s in starts[1:]:
            document[s:] += 1
        position = torch.arange(32) - torch.tensor(starts)[document]
        assert torch.equal(torch.as_tensor(reset["position_ids"]), position)
        # True where attention is masked out: later tokens, and other documents
        masked = torch.as_tensor(reset["attention_mask"]).reshape(32, 32)
        allowed = (document[:, None] == document[None, :]) & torch.ones(32, 32).tril().bool()
        assert torch.equal(masked, ~allowed)
    assert spanning >= 50  # of the 209 samples, those an EOD splits


def test_logging_level_from_the_flag_else_the_environment(monkeypatch):
    import logging

    from megatron.hetero.log import configure_logging

    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        monkeypatch.delenv("MEGATRON_LOGGING_LEVEL", raising=False)
        assert configure_logging(_args()) is None and root.level == level
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "30")
        assert configure_logging(_args()) == 30 and root.level == 30
        assert configure_logging(_args("--logging-level 10")) == 10 and root.level == 10
        assert root.handlers
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers
