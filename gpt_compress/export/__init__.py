"""Export a checkpoint to deployable programs: Paddle Inference (``static``) and ONNX (``onnx``)."""
