"""How a run's saved config (config.json, a checkpoint's metadata) changed layout over versions, and how an old
one is read: every reader of a run sees today's layout (`migrate`)."""


# Keys that moved when the model config was split into architecture (model.*) and how it runs (execution.*; the
# balance-loss weight is part of the training loss). Run configs saved before the move are read through `migrate`.
MOVED_KEYS = {
    **{f"model.{k}": f"execution.{k}" for k in ("dispatch", "capacity_factor", "grouped_matmul", "attention_impl",
                                                "dtype", "remat")},
    "model.balance_loss_weight": "train.balance_loss_weight",
    "model.router_score": "model.router",  # renamed when routers became a table (moe/router.py)
}


def migrate(config: dict) -> dict:
    """A run config saved by an earlier version (a plain dict) in today's layout: moved keys moved, the rest as
    it was. Only keys the earlier layout held move; nothing else is filled in."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in config.items()}
    for old, new in MOVED_KEYS.items():
        old_section, old_key = old.split(".")
        new_section, new_key = new.split(".")
        if isinstance(out.get(old_section), dict) and old_key in out[old_section]:
            value = out[old_section].pop(old_key)
            out.setdefault(new_section, {}).setdefault(new_key, value)
    return out


# Keys added after the model/execution split, with the default that reproduces the runs from before them.
# (loss_chunks: the runs before it computed all logits at once, which the chunked default reproduces up to
# floating-point rounding only; scan_layers and permute_grad likewise, permute_grad's `auto` gathering on GPUs where
# earlier runs scatter-added; experiments.common.runs.fingerprint leaves any value of the three out.)
ADDED_KEYS = {"eval.dispatch": "", "execution.loss_chunks": 8, "execution.scan_layers": False,
              "execution.remat_policy": "full", "execution.permute_grad": "auto",
              # MLA, YaRN, DeepSeek-V2's group score, multi-token prediction
              "model.attention": "gqa", "model.q_lora_rank": 0, "model.kv_lora_rank": 0, "model.qk_nope_head_dim": 0,
              "model.qk_rope_head_dim": 0, "model.v_head_dim": 0, "model.rope_interleave": False,
              "model.latent_norm_eps": 0.0, "model.rope_scaling_factor": 1.0, "model.rope_original_max_position": 0,
              "model.yarn_beta_fast": 32.0, "model.yarn_beta_slow": 1.0, "model.yarn_mscale": 0.0,
              "model.yarn_mscale_all_dim": 0.0, "model.router_group_score": "top2_sum", "model.mtp_depth": 0,
              "train.mtp_weight": 0.3, "train.mtp_weight_late": 0.1, "train.mtp_weight_switch": 1.0,
              # a run saved before the setting existed is read with the compilation cache off
              "train.compile_cache_dir": "",
              # the router catalogue (moe/router.py): each at its default, which reproduces every earlier run; listed
              # so that pre_split_layout leaves them out of the fingerprints of studies finished before them
              "model.n_zero_experts": 0, "model.router_logit_bias": False, "model.n_hash_layers": 0,
              "model.layer_top_k": "", "train.balance_loss_scope": "sequence", "train.router_z_loss_weight": 0.0,
              # imported families' attention options (Hunyuan-A13B)
              "model.qk_norm_after_rope": False, "model.max_keys": 0,
              "model.query_scale_beta": 0.0, "model.query_scale_period": 0, "model.query_scale_offset": 0,
              "model.nope_layers": "", "model.attention_chunk": 0, "model.rope_scaling": "yarn",
              "model.llama3_low_freq_factor": 1.0, "model.llama3_high_freq_factor": 4.0,
              "model.sliding_window": 0, "model.sliding_layers": "", "model.attn_sinks": False,
              "model.yarn_truncate": True, "model.expert_act": "swiglu", "model.swiglu_limit": 7.0,
              "model.swiglu_alpha": 1.702, "model.expert_bias": False, "model.dual_sublayers": False,
              "model.mla_lora_scale": False,
              # Qwen3-Next's gated attention, zero-centred norms and Gated DeltaNet layers
              "model.attn_output_gate": False, "model.norm_offset": False, "model.linear_layers": "",
              "model.gdn_key_heads": 0, "model.gdn_value_heads": 0, "model.gdn_key_dim": 0, "model.gdn_value_dim": 0,
              "model.gdn_conv_kernel": 4}


def up_to_date(config: dict) -> dict:
    """A run config saved by any version (config.json, a checkpoint's metadata) in today's layout: moved keys
    moved, keys added since at the default that reproduces the run, the record of where it ran left out."""
    out = migrate(config)
    out.pop(RESOLVED_KEY, None)
    for key, default in ADDED_KEYS.items():
        section, name = key.split(".")
        if isinstance(out.get(section), dict):
            out[section].setdefault(name, default)
    return out


# Recorded beside the config in config.json at a run's creation: the platform and what each `auto` execution choice
# became there (moe.Execution.resolved). Where a run ran is not part of what it is: fingerprints leave it out.
RESOLVED_KEY = "resolved_execution"
RESOLVED_FIELDS = ("platform", "grouped_matmul", "permute_grad", "attention_impl")


def pre_split_layout(config: dict) -> dict:
    """The inverse of `migrate`, for fingerprints that must not change with the layout: moved keys back where
    they were, keys added since at their defaults (ADDED_KEYS) and the record of where the run ran left out."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in config.items()
           if section != RESOLVED_KEY}
    for old, new in MOVED_KEYS.items():
        old_section, old_key = old.split(".")
        new_section, new_key = new.split(".")
        if isinstance(out.get(new_section), dict) and new_key in out[new_section]:
            out.setdefault(old_section, {})[old_key] = out[new_section].pop(new_key)
    for key, default in ADDED_KEYS.items():
        section, name = key.split(".")
        if isinstance(out.get(section), dict) and out[section].get(name, None) == default:
            del out[section][name]
    if out.get("execution") == {}:
        del out["execution"]
    return out
