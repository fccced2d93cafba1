"""Training side: trainer log-probs and the policy loss (pure math), and the trainer wiring.

- `logprobs.py`: hidden states -> trained tokens' log-probs, top-K log-probs, entropy (chunked).
- `loss.py`: importance ratio and mask, clipped surrogate or score-centering loss, metric statistics.
"""
