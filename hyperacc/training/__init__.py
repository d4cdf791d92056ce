"""Layer 4: the pieces of a training step: gradient accumulation, the router aux loss, step checks, the replica guard, metrics and their sinks, the step hooks that run them in order (`hyperacc.training.hooks`), and small loop helpers."""
from hyperacc.training.loop import (  # noqa: F401 - the package's public names
    param_groups,
    lr_lambda_scheduler,
    eval_batch_indices,
    evaluate,
    raise_if_any_rank_failed,
    check_same_config,
)
