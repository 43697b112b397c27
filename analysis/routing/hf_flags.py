"""The flag combinations `python -m analysis.routing` allows with --hf and without it, checked before anything
heavy loads."""

from plumbing.errors import UserError


def check_routing_flags(args) -> None:
    """The flag combinations analysis.routing --hf allows (one-line UserError otherwise)."""
    if args.hf is None:
        for flag in ("text", "seq_len", "memory_gb"):
            if getattr(args, flag, None) is not None:
                raise UserError(f"--{flag} goes with --hf (a run directory uses its own data and seq_len)")
        if getattr(args, "mode", "auto") != "auto":
            raise UserError("--mode goes with --hf (a run's model is always in memory)")
        if any(getattr(args, f"mesh_{a}", None) is not None for a in ("data", "fsdp", "expert", "tensor")):
            raise UserError("--mesh.* goes with --hf (a run's analysis runs on one device)")
        return
    for flag in ("step", "compare_step"):
        if getattr(args, flag) is not None:
            raise UserError(f"--{flag} needs --workdir: a HuggingFace directory has one set of weights")
    if getattr(args, "memory_gb", None) is not None and args.memory_gb <= 0:
        raise UserError(f"--memory_gb must be > 0, got {args.memory_gb}")
    if getattr(args, "mode", "auto") != "auto" and any(getattr(args, f"mesh_{a}", None) is not None
                                                       for a in ("data", "fsdp", "expert", "tensor")):
        raise UserError(f"--mode {args.mode} and --mesh.* exclude each other: on a mesh the model is imported sharded")
    if args.text and args.split is not None:
        raise UserError("--text and --split exclude each other: --split picks a split of the bundled corpus")
    if args.out is None:
        raise UserError("--out is required with --hf (the model directory is left untouched)")
    if args.seq_len is not None and args.seq_len < 2:
        raise UserError(f"--seq_len must be >= 2, got {args.seq_len}")
