"""What describes a model, below both the trainer and the server: model files in other formats turned
into model folders (`gguf`). Nothing here imports the trainer, the server or the rollout code."""
