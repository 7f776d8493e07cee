"""Backends that run a GPT for decoding and scoring (dygraph, Paddle Inference, onnxruntime)."""
