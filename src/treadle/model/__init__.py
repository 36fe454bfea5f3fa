"""The model floor: Llama-family decoders in PyTorch, their layers, and weight loading."""
