"""Hugging Face weights at scale: each rank reads only its own slices of the safetensors files
(`load`), every rank writes part of an export (`export`), the naming between a model's parameters
and the checkpoint's keys (`layout`), and the files themselves (`files`, `writer`)."""
