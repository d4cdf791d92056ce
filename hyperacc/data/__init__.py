"""Data: the stateful micro-batch loader, collators, text pipeline and Megatron format.

Exports are lazy so that `import hyperacc.data.megatron` (and the convert CLI) stay light.
"""
_EXPORTS = {
    "MicroBatchDataLoader": "hyperacc.data.loader",
    "default_collate": "hyperacc.data.collate",
    "pad_collate": "hyperacc.data.collate",
    "build_train_dataset": "hyperacc.data.text",
    "IndexedDataset": "hyperacc.data.megatron",
    "IndexedDatasetWriter": "hyperacc.data.megatron_writer",
    "PackedDataset": "hyperacc.data.packed",
    "BlendedDataset": "hyperacc.data.packed",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hyperacc.data' has no attribute {name!r}")
