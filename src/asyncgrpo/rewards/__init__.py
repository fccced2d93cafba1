"""Ready-made reward functions (conversational completions; usable with `reward_funcs=`)."""

from asyncgrpo.rewards.accuracy import accuracy_reward
from asyncgrpo.rewards.format import boxed_format_reward, boxed_number_format_reward, think_format_reward

__all__ = ["accuracy_reward", "boxed_format_reward", "boxed_number_format_reward", "think_format_reward"]
