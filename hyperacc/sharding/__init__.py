"""Layer 3: FSDP2 sharding of a model (meta-device materialisation, recompute, offload, mixed precision),
per-block torch.compile, replicated scalars and optimizer rebinding; `parallelize` composes them with
TP/EP/CP into one pipeline."""
from hyperacc.sharding.fsdp import (  # noqa: F401 - the package's public names
    block_classes,
    find_blocks,
    enable_recompute,
    cast_parameters,
    materialize,
    rank0_only_weights_expected,
    broadcast_from_rank0,
    reshard,
)
from hyperacc.sharding.parallelize import parallelize, shard_model  # noqa: F401,E402
