"""What describes a model, below both the trainer and the server: nothing here imports another package
of asyncgrpo, and both `train/` and `server/` (and `packing/`) import from here.

    load.py        model ids, loaders (the trainer's and the server's alike), dtype names, hub kernels off
    support.py     which model families the trainer and the embedded server run, and why the others not
    deltanet/      the Gated DeltaNet math that training and serving share (delta rule, the layer's steps)
    lora_rules.py  the LoRA rules the trainer and the server share (allowed ranks, plain inits)
    gguf.py        model files in the GGUF format turned into model folders

Import the modules, not the package: it re-exports nothing, so `import asyncgrpo.modeling.lora_rules`
(the CLI's) loads neither torch nor transformers.
"""
