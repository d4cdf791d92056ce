"""Hugging Face weights at scale: each rank reads only its own slices of the safetensors files
(`load`), every rank writes part of an export (`export`), the naming between a model's parameters
and the checkpoint's keys (`layout`), and the files themselves (`files`, `writer`)."""
from hyperacc.weights.export import save_model_sharded
from hyperacc.weights.load import fill_shards, source_of

__all__ = ["fill_shards", "save_model_sharded", "source_of"]
