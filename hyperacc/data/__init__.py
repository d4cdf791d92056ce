"""Data: the stateful micro-batch loaders (map-style and streams), collators, text and chat pipelines and Megatron format.

Exports are lazy so that `import hyperacc.data.megatron` (and the convert CLI) stay light.
"""
_EXPORTS = {
    "MicroBatchDataLoader": "hyperacc.data.loader",
    "StreamingDataLoader": "hyperacc.data.streaming",
    "TextWindows": "hyperacc.data.stream_samples",
    "ChatRecords": "hyperacc.data.stream_samples",
    "default_collate": "hyperacc.data.collate",
    "pad_collate": "hyperacc.data.collate",
    "build_train_dataset": "hyperacc.data.text",
    "IndexedDataset": "hyperacc.data.megatron",
    "IndexedDatasetWriter": "hyperacc.data.megatron_writer",
    "PackedDataset": "hyperacc.data.packed",
    "BlendedDataset": "hyperacc.data.packed",
    "prepare_chat_tokenizer": "hyperacc.data.chat",
    "build_chat_dataset": "hyperacc.data.chat_dataset",
    "chat_collate": "hyperacc.data.chat_dataset",
    "pack_collate": "hyperacc.data.packing",
    "ChatIndexedDataset": "hyperacc.data.megatron_chat",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hyperacc.data' has no attribute {name!r}")
