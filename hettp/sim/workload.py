"""What one micro-batch of a GPT model costs, per het-TP unit: the numbers the simulator turns
into seconds (FLOPs over a GPU's speed) and bytes (over links).

A unit's work is what megatron/hetero/partition.py weighs it at for the planner: its
parameters, plus an attention unit's core attention in parameters' terms
(hettp.step_model.core_attention_work); its bytes are its parameters'."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..plan import HeadUnits, PartitionPlan
from ..step_model import core_attention_work
from ..transfer import KV_REPLICA


class WorkloadError(ValueError):
    """A model shape the simulator cannot split."""


@dataclass(frozen=True)
class ModelSpec:
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    query_groups: int
    seq: int
    micro_batch: int
    vocab: int
    swiglu: bool = False
    # bytes a parameter carries when it migrates: weights plus the optimizer's copies of it
    # (bf16 weights + fp32 master + two fp32 Adam moments = 14; fp32 on CPU without masters: 12)
    state_bytes: int = 14
    grad_bytes: int = 4  # per gradient element in the data-parallel reduce (fp32 under bf16)
    activation_bytes: int = 2  # bytes per activation element on the wire
    mlp_unit: int = 1  # ffn neurons per MLP unit (--het-tp-granularity)
    # query heads per attention unit (--het-tp-attn-granularity); 0: whole query groups
    attn_unit: int = 0
    tied_embeddings: bool = True  # unless --untie-embeddings-and-output-weights

    def __post_init__(self):
        if min(self.num_layers, self.hidden, self.ffn, self.heads, self.seq) < 1:
            raise WorkloadError(f"model sizes must be positive: {self}")
        if self.mlp_unit < 1 or self.ffn % self.mlp_unit:
            raise WorkloadError(
                f"--het-tp-granularity {self.mlp_unit} does not divide the ffn size {self.ffn}"
            )
        if self.hidden % self.heads or self.heads % self.query_groups:
            raise WorkloadError(
                f"hidden {self.hidden}, heads {self.heads} and query groups "
                f"{self.query_groups} must divide evenly"
            )
        per_group = self.heads // self.query_groups
        if self.attn_unit < 0 or (self.attn_unit and per_group % self.attn_unit):
            raise WorkloadError(
                f"--het-tp-attn-granularity {self.attn_unit} does not divide the {per_group} "
                "query heads of a group (or be 0 for whole groups)"
            )

    @property
    def head_units(self) -> HeadUnits | None:
        """The plan's attention units when they are finer than a query group (a unit of a
        whole group's heads is a group unit, as in the trainer: hettp.config)."""
        per_group = self.heads // self.query_groups
        if not 0 < self.attn_unit < per_group:
            return None
        return HeadUnits(self.attn_unit, per_group, self.query_groups)

    @property
    def attn_units(self) -> int:
        heads = self.head_units
        return heads.units if heads is not None else self.query_groups

    @property
    def _unit_heads(self) -> int:
        """Query heads an attention unit computes."""
        heads = self.head_units
        return heads.heads_per_unit if heads is not None else self.heads // self.query_groups

    @property
    def kv_channels(self) -> int:
        return self.hidden // self.heads

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch

    def unit_params(self) -> dict[str, int]:
        """Parameters of one unit: a query group's Q, K and V rows and projection columns (with
        head units, its query heads' rows and columns, and under `kv` one group's K and V rows:
        the replica a rank holding any of the group's heads computes); one ffn neuron's fc1
        row(s) and fc2 column."""
        mlp = (3 if self.swiglu else 2) * self.hidden * self.mlp_unit
        kv = 2 * self.kv_channels * self.hidden
        if self.head_units is not None:
            return {
                "attn": 2 * self.attn_unit * self.kv_channels * self.hidden,
                "mlp": mlp,
                KV_REPLICA: kv,
            }
        return {"attn": 2 * self._unit_heads * self.kv_channels * self.hidden + kv, "mlp": mlp}

    def unit_work(self) -> dict[str, int]:
        """What the planner weighs a unit at, as the runtime does."""
        work = self.unit_params()
        core = core_attention_work(self._unit_heads, self.seq, self.kv_channels)
        return {**work, "attn": work["attn"] + core}

    def unit_flops(self) -> dict[str, float]:
        """Forward plus backward FLOPs of one unit for one micro-batch (3x the forward)."""
        params = self.unit_params()
        core = 4 * self.micro_batch * self.seq**2 * self.kv_channels * self._unit_heads  # QK^T, AV
        flops = {block: 6.0 * self.tokens * n for block, n in params.items()}
        return {**flops, "attn": flops["attn"] + 3.0 * core}

    def logits_flops(self, tp: int) -> float:
        """The output layer's, per TP rank (vocab-parallel, even: no unit moves it)."""
        return 6.0 * self.tokens * self.hidden * self.vocab / tp

    def layer_params(self) -> int:
        params = self.unit_params()
        replicas = self.query_groups * params.get(KV_REPLICA, 0)  # each group's K/V once
        return self.attn_units * params["attn"] + replicas + self.mlp_units * params["mlp"]

    @property
    def mlp_units(self) -> int:
        return self.ffn // self.mlp_unit

    def activation(self) -> int:
        """Bytes of one micro-batch's hidden states: a TP all-reduce's or a stage hand-off's."""
        return self.tokens * self.hidden * self.activation_bytes

    def even_plan(self, tp: int, layers: int) -> PartitionPlan:
        if self.attn_units % tp or self.mlp_units % tp:
            what = "attention units" if self.head_units is not None else "query groups"
            raise WorkloadError(
                f"{what} ({self.attn_units}) and MLP units ({self.mlp_units}) must "
                f"divide by TP {tp}"
            )
        return PartitionPlan.even(
            tp, layers, self.attn_units, self.mlp_units, self.mlp_unit, self.head_units
        )

    @classmethod
    def from_megatron_args(cls, argv: Sequence[str], **overrides) -> ModelSpec:
        """The shape Megatron's flags (as compare.py records them) describe."""
        values = {}
        argv = list(argv)
        for i, arg in enumerate(argv):
            if arg.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                values[arg[2:].replace("-", "_")] = argv[i + 1]
            elif arg.startswith("--"):
                values[arg[2:].replace("-", "_")] = True
        try:
            hidden = int(values["hidden_size"])
            heads = int(values["num_attention_heads"])
            fields = dict(
                num_layers=int(values["num_layers"]),
                hidden=hidden,
                ffn=int(values.get("ffn_hidden_size", 4 * hidden)),
                heads=heads,
                query_groups=int(values.get("num_query_groups", heads))
                if values.get("group_query_attention")
                else heads,
                seq=int(values["seq_length"]),
                micro_batch=int(values.get("micro_batch_size", 1)),
                vocab=int(values.get("vocab_size", 50257)),
                swiglu=bool(values.get("swiglu", False)),
                tied_embeddings=not values.get("untie_embeddings_and_output_weights", False),
            )
        except KeyError as missing:
            raise WorkloadError(
                f"model flags lack --{str(missing.args[0]).replace('_', '-')}"
            ) from None
        fields.update(overrides)
        return cls(**fields)


# A Llama-3-70B-like model (GQA with 8 KV groups, SwiGLU), the shape users train at TP=8.
LLAMA_70B = ModelSpec(
    num_layers=80,
    hidden=8192,
    ffn=28672,
    heads=64,
    query_groups=8,
    seq=4096,
    micro_batch=1,
    vocab=128256,
    swiglu=True,
)
# A GPT-3-style 13B MHA model.
GPT_13B = ModelSpec(
    num_layers=40,
    hidden=5120,
    ffn=20480,
    heads=40,
    query_groups=40,
    seq=2048,
    micro_batch=1,
    vocab=50257,
)
MODELS = {"llama-70b": LLAMA_70B, "gpt-13b": GPT_13B}
