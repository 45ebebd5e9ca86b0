"""Weights kept quantized: the row formats (``quant_types``), GGUF files (``gguf_file``) and the
linear layers that multiply over them (``quantized_linear``)."""
