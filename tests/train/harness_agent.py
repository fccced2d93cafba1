"""A command harness for tests/train/test_harness_trainer.py: one chat call through the endpoint the
trainer gives it (OPENAI_BASE_URL / OPENAI_API_KEY), its reward written to $ASYNCGRPO_REWARD_FILE (a
random one unless the answer is right: the test needs groups with distinct rewards, not learning)."""

import json
import os
import random

import openai

client = openai.OpenAI(max_retries=0)  # reads OPENAI_BASE_URL and OPENAI_API_KEY
prompt = json.loads(os.environ["ASYNCGRPO_PROMPT"])
row = json.loads(os.environ["ASYNCGRPO_ROW"])
reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=prompt)
correct = row["answer"] in (reply.choices[0].message.content or "")
with open(os.environ["ASYNCGRPO_REWARD_FILE"], "w") as f:
    f.write("1.0" if correct else str(random.random() / 2))
