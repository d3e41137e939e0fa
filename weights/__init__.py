"""Loading weights into model.py's Llama: HF safetensors directories, GGUF files (the embedded
SmolLM2), random weights of any shape, and HF transformers' model on the same weights
(loader.py)."""
