"""Training data: the prompt stream (`data.prompts`) the rollout process generates from."""
