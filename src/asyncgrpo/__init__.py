"""asyncgrpo: asynchronous GRPO training of language models.

Generation runs on an inference server (vLLM, or the embedded server of this package); a rollout
process streams and scores completions while the trainer consumes them, so generation and
gradient updates overlap.
"""

__version__ = "0.1.0"
