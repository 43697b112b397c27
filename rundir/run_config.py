"""A run's config, typed: frozen sections (model, execution, train, data, mesh, eval, log, checkpoint), each field
with its checks and a one-line description, validated once when the run config is parsed.

    rc = RunConfig.parse(config_dict)     # ml_collections.ConfigDict (configs/, the command line) or a plain dict
    rc.train.steps, rc.model.n_layers     # what the code reads; every function takes the section it needs

configs/base.py builds its ConfigDict from these defaults, so a default is declared once, here (model and execution:
moe.ModelConfig and moe.Execution). A run's config.json and its checkpoints' metadata hold `to_dict()`; readers
parse them after rundir.config_layout has brought an earlier layout up to date.
"""

import dataclasses
import difflib

from moe import Execution, ModelConfig
from moe.dispatch.execution import DISPATCH_MODES, check_model, execution_fields
from plumbing.errors import ConfigError
from plumbing.fields import (
    at_least,
    between,
    check_fields,
    field,
    from_dict,
    non_negative,
    nonempty,
    one_of,
    positive,
)

TASKS = ("lm", "prefix", "mlm")
BALANCE_SCOPES = ("sequence", "micro_batch", "global_batch")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = field(1000, positive, doc="optimizer steps of the whole run")
    seed: int = field(0, non_negative, doc="the initial weights' and the data order's seed")
    batch_size: int = field(32, positive, doc="rows per step, global (over all devices and hosts)")
    grad_accum: int = field(1, positive, doc="micro-batches per step (the routing load is summed over all of them)")
    lr: float = field(3e-3, positive, doc="peak learning rate")
    min_lr_ratio: float = field(0.1, between(0, 1), doc="the schedule's final learning rate / lr")
    warmup_steps: int = field(100, non_negative, doc="linear warmup steps")
    schedule: str = field("cosine", one_of("cosine", "wsd"), doc="cosine | wsd (warmup-stable-decay: linear decay "
                                                                 "over the last decay_frac)")
    decay_frac: float = field(0.2, between(0, 1, low_open=True), doc="wsd: the fraction of the run that decays")
    weight_decay: float = field(0.1, non_negative, doc="AdamW's weight decay (never on norms or routing biases)")
    b1: float = field(0.9, between(0, 1, high_open=True), doc="Adam's beta1")
    b2: float = field(0.95, between(0, 1, high_open=True), doc="Adam's beta2")
    eps: float = field(1e-8, positive, doc="Adam's epsilon")
    grad_clip: float = field(1.0, positive, doc="the global gradient norm is clipped to this")
    bias_update_rate: float = field(1e-3, non_negative, doc="gamma of aux-loss-free balancing (0: the routing "
                                                            "biases stay)")
    bias_update_stop: float = field(1.0, between(0, 1), doc="fraction of the run after which gamma is 0 "
                                                            "(DeepSeek-V3 stops it late)")
    prefix_loss: bool = field(False, doc="prefix/mixed masks: prefix positions carry loss too (UniLM: no)")
    # the equal-targets control: loss on every token's positions but no more targets per step than output-only
    equal_targets: bool = field(False, doc="with prefix_loss: keep a random subset of a row's targets, as many as "
                                           "its output part has")
    balance_loss_weight: float = field(1e-4, non_negative, doc="alpha of the balance loss (0: off)")
    # train/step.py says what each scope covers with gradient accumulation.
    balance_loss_scope: str = field("sequence", one_of(*BALANCE_SCOPES),
                                    doc="the tokens f_i and P_i of the balance loss count: sequence (DeepSeek-V3) | "
                                        "micro_batch (each data-parallel shard's rows) | global_batch (every row on "
                                        "every device; Qwen)")
    router_z_loss_weight: float = field(0.0, non_negative, doc="weight of the router z-loss, mean logsumexp(logits)^2 "
                                                               "(ST-MoE; 0: off)")
    # lambda / D * the D depths' losses; validation reports the main loss alone
    mtp_weight: float = field(0.3, non_negative, doc="lambda of the multi-token prediction loss (DeepSeek-V3: 0.3)")
    mtp_weight_late: float = field(0.1, non_negative, doc="lambda after mtp_weight_switch (DeepSeek-V3: 0.1)")
    mtp_weight_switch: float = field(1.0, between(0, 1), doc="the fraction of the run after which lambda is "
                                                             "mtp_weight_late")
    # A run that builds the same programs (a resume, another seed) loads them from here; JAX_COMPILATION_CACHE_DIR,
    # when set, wins. The run's readers cache in the default directory (or nowhere when this is "").
    compile_cache_dir: str = field("~/.cache/moe-lm/jax", doc="JAX's persistent compilation cache ('' turns it "
                                                              "off; rundir/compile_cache.py)")

    def __post_init__(self):
        check_fields(self, "train")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"train.batch_size ({self.batch_size}) must be divisible by train.grad_accum "
                              f"({self.grad_accum})")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    name: str = field("moe_corpus", nonempty, doc="a TFDS text data set prepared as array_record, e.g. lm1b; "
                                                  "moe_corpus: the bundled 9-domain corpus")
    split: str = field("train", nonempty, doc="the training split")
    eval_split: str = field("validation", nonempty, doc="the validation split")
    text_field: str = field("text", nonempty, doc="the feature holding the text")
    corpus_dir: str = field("", doc="moe_corpus only; '' = the bundled corpus (train/data/corpus)")
    tfds_data_dir: str = field("", doc="'' = ~/.cache/moe-lm/tfds")
    tokenizer: str = field("", doc="'' = the bundled train/data/tokenizer.json (8,192); tokenizer_1k.json: the "
                                   "bundled 1,024")
    token_cache_dir: str = field("", doc="'' = ~/.cache/moe-lm/tokens")
    seq_len: int = field(256, at_least(2), doc="tokens per row")
    task: str = field("lm", one_of(*TASKS), doc="lm: packed rows | prefix: one document per row, input prefix + "
                                                "output (loss on the output) | mlm: masked LM")
    prefix_frac: float = field(0.5, between(0, 1, low_open=True, high_open=True), doc="prefix task: the prefix's "
                                                                                      "share of a row")
    windows: bool = field(False, doc="prefix task: cut every document into seq_len windows (all text used), not "
                                     "its start")

    def __post_init__(self):
        check_fields(self, "data")


MESH_AXES = ("data", "fsdp", "expert", "tensor")


def _devices_or_rest(v):
    return None if v >= 1 or v == -1 else "must be a positive integer or -1 (the remaining devices)"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = field(-1, _devices_or_rest, doc="data-parallel devices (-1: the remaining devices)")
    fsdp: int = field(1, _devices_or_rest, doc="devices the parameters are sharded over (ZeRO-3), the batch too")
    expert: int = field(1, _devices_or_rest, doc="devices the routed experts are split over")
    tensor: int = field(1, _devices_or_rest, doc="devices heads and FFN widths are split over (Megatron)")

    def __post_init__(self):
        check_fields(self, "mesh")
        if sum(getattr(self, a) == -1 for a in MESH_AXES) > 1:
            raise ConfigError("mesh: at most one axis may be -1 (the remaining devices); set the others explicitly")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = field(200, positive, doc="steps between checkpoints (and the last step)")
    keep: int = field(3, positive, doc="checkpoints kept")
    async_save: bool = field(True, doc="save in the background while training goes on")

    def __post_init__(self):
        check_fields(self, "checkpoint")


@dataclasses.dataclass(frozen=True)
class LogConfig:
    every: int = field(10, positive, doc="steps between metrics lines")
    peak_flops: float = field(0.0, non_negative, doc="per device, for MFU; 0 measures a large matmul at start")
    tensorboard: bool = field(True, doc="also write TensorBoard events")
    progress: bool = field(True, doc="a progress bar with an ETA")

    def __post_init__(self):
        check_fields(self, "log")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = field(200, positive, doc="steps between validations (and the last step)")
    rows_per_domain: int = field(8, positive, doc="validation rows of each domain")
    batch_size: int = field(16, positive, doc="rows per validation batch")
    # "dropless" (or "capacity", one capacity per sequence) makes a row's evaluation loss independent of the other
    # rows in its batch.
    dispatch: str = field("", one_of("", *DISPATCH_MODES), doc="the validation's dispatch ('' = "
                                                               "execution.dispatch)")
    output_only: bool = field(False, doc="prefix task: validation scores the output part even when "
                                         "train.prefix_loss is set (studies)")

    def __post_init__(self):
        check_fields(self, "eval")


SECTIONS = {"train": TrainConfig, "data": DataConfig, "mesh": MeshConfig, "checkpoint": CheckpointConfig,
            "log": LogConfig, "eval": EvalConfig}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    execution: Execution = dataclasses.field(default_factory=Execution)  # how it runs; its mesh is the run's
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    def __post_init__(self):
        """What ties the sections together."""
        m, d, t = self.model, self.data, self.train
        check_model(self.execution, m)
        if t.equal_targets and not (d.task == "prefix" and t.prefix_loss):
            raise ConfigError("train.equal_targets subsamples the targets of train.prefix_loss: set "
                              "data.task='prefix' and train.prefix_loss=True, or drop it")
        if d.task == "prefix" and m.mask == "bidirectional":
            raise ConfigError("data.task='prefix' trains next-token prediction: use model.mask causal, prefix or "
                              "mixed")
        if d.task == "mlm" and m.mask not in ("bidirectional", "mixed"):
            raise ConfigError(f"data.task='mlm' (masked LM) needs model.mask bidirectional or mixed, got {m.mask!r}")
        if m.mask == "prefix" and d.task != "prefix" or m.mask == "mixed" and d.task == "lm":
            raise ConfigError(f"model.mask={m.mask!r} needs a per-row prefix: set data.task='prefix'")
        if self.execution.attention_impl == "cudnn" and d.seq_len % 2:
            raise ConfigError(f"execution.attention_impl='cudnn' trains only even sequence lengths (a cuDNN limit "
                              f"with a mask), got data.seq_len={d.seq_len}; use an even length or "
                              "attention_impl='xla'")

    @classmethod
    def parse(cls, config) -> "RunConfig":
        """From a ConfigDict or a plain dict of sections (today's layout: rundir.config_layout.migrate brings an
        earlier one up to date): ConfigError naming the first unknown key or bad value."""
        values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"unknown config section {unknown[0]!r}; the sections are "
                              f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        sections = {"model": from_dict(ModelConfig, values.get("model", {}), "model"),
                    "execution": from_dict(Execution, _execution_keys(values.get("execution", {})), "execution")}
        for name, section in SECTIONS.items():
            sections[name] = from_dict(section, values.get(name, {}), name)
        return cls(**sections)

    def to_dict(self) -> dict:
        """Every section as plain values (config.json, a checkpoint's metadata, configs/base.py's defaults)."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in ("model", *SECTIONS)}
        out["execution"] = {k: getattr(self.execution, k) for k in execution_fields()}
        return {name: out[name] for name in ("model", "execution", *SECTIONS)}

    def execution_on(self, mesh=None, *, evaluation: bool = False) -> Execution:
        """The Execution for training (or, evaluation=True, the validation's: eval.dispatch when set) on `mesh`."""
        ex = self.execution.replace(mesh=mesh)
        return ex.replace(dispatch=self.eval.dispatch) if evaluation and self.eval.dispatch else ex


def _execution_keys(values: dict) -> dict:
    """The execution section as the user sets it: the mesh, rules and platform are the run's, never a config's."""
    settable = list(execution_fields())
    for key in values:
        if key not in settable:
            close = difflib.get_close_matches(key, settable, n=1, cutoff=0.6)
            hint = f"; did you mean execution.{close[0]}?" if close else ""
            raise ConfigError(f"unknown config key execution.{key}{hint}")
    return values


def field_docs() -> dict[str, str]:
    """'section.key' -> its one-line description, for every key of a run config (what --help prints)."""
    out = {}
    for name, cls in (("model", ModelConfig), ("execution", Execution), *SECTIONS.items()):
        for f in dataclasses.fields(cls):
            if f.metadata.get("doc"):
                out[f"{name}.{f.name}"] = f.metadata["doc"]
    return out
