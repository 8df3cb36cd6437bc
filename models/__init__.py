"""What a model is: its config, its layers, and the forms its weights run in."""

QUANT_MODES = ("none", "int8", "int4")  # --quant: the linear weights as stored, or quantized as read (models/quantized.py)
GROUP_SIZES = (32, 64, 128)  # --group-size: the inputs that share an int4 scale and zero
GGUF_GROUP = 32  # llama.cpp's 4-bit blocks: the 32 weights of a row that share a scale (weights/gguf_blocks.py)
