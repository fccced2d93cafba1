"""The Gated DeltaNet layers of hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): the math that tree
packing (training) and the embedded server (serving) both run.

    layer.py       the layer's own steps around the delta rule: finding the layers, its input
                   projections and gates, the causal convolution, the gated norm and output projection
    delta_rule.py  the chunked gated delta rule (pure PyTorch) over a forest of segments or a padded batch

How the tokens reach them differs: a tree-packed row follows its trie (`packing/recurrent.py`,
`packing/deltanet.py`), a server step reads and writes per-sequence states
(`server/recurrent_state.py`). Those stay with their callers; only the shared math lives here.
"""
