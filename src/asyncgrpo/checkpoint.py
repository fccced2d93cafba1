"""`rollout_state.json`: what the rollout side needs to resume from a Trainer checkpoint.

Saved beside every checkpoint:

    {"trained_position": <int>, "model_version": <int>, "trained_above": [<int>, ...], "num_tokens": <int>}

`trained_position` is the index of the first prompt (in the rollout process's prompt stream,
epoch * len(dataset) + index in that epoch's order) not yet trained: the trained position, not the
generator's, so that nothing generated-but-untrained is skipped on resume. `trained_above` lists the
prompts above it that are already trained (they finished out of order; at most a few steps' worth):
the resumed rollout skips them, so every prompt is trained exactly once per epoch. `model_version` is
the number of weight syncs so far; versions keep increasing across a resume. `num_tokens` is the
logged `num_tokens` (tokens forwarded so far, every process): a resumed run goes on counting from it.
A file without `trained_above` or `num_tokens` (an older version) reads as an empty list and 0.

Beside it, `rollout_pending.pkl` (only when there are any) keeps the untrained samples of prompts partly
trained at the checkpoint: their group straddled two optimizer steps. A resumed run trains them first
and does not generate those prompts again, so every sample is trained exactly once.
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROLLOUT_STATE_FILE = "rollout_state.json"
# the untrained samples of prompts partly trained at the checkpoint (their group straddled two steps)
ROLLOUT_PENDING_FILE = "rollout_pending.pkl"


@dataclass(frozen=True)
class RolloutState:
    """Resume state of the rollout side (see the module docstring)."""

    trained_position: int = 0
    model_version: int = 0
    trained_above: tuple[int, ...] = ()
    num_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("trained_position", "model_version", "num_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RolloutState.{name} must be a non-negative int, got {value!r}")
        above = self.trained_above
        if not all(isinstance(p, int) and not isinstance(p, bool) and p > self.trained_position
                   for p in above):
            raise ValueError(
                f"RolloutState.trained_above must hold ints above trained_position={self.trained_position}, "
                f"got {list(above)!r}"
            )
        object.__setattr__(self, "trained_above", tuple(sorted(set(above))))

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "trained_above": list(self.trained_above)}, indent=2,
                          sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = ROLLOUT_STATE_FILE) -> RolloutState:
        """Parse `text`; `source` names the file in errors."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{source} is not valid JSON ({exc}); delete it to restart the prompt stream"
            ) from exc
        keys = ("trained_position", "model_version")
        missing = [k for k in keys if k not in data] if isinstance(data, dict) else list(keys)
        if missing:
            raise ValueError(
                f"{source} must hold a JSON object with keys {list(keys)}; missing {missing} in {text[:80]!r}"
            )
        above = data.get("trained_above", [])
        if not isinstance(above, list):
            raise ValueError(f"{source}: trained_above must be a list of prompt positions, got {above!r}")  # noqa: TRY004 -- a malformed file, as above
        try:
            return cls(
                trained_position=data["trained_position"], model_version=data["model_version"],
                trained_above=tuple(above), num_tokens=data.get("num_tokens", 0),
            )
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


def rollout_state_path(checkpoint_dir: str | os.PathLike) -> Path:
    return Path(checkpoint_dir) / ROLLOUT_STATE_FILE


def write_rollout_state(checkpoint_dir: str | os.PathLike, state: RolloutState) -> Path:
    """Write `rollout_state.json` into `checkpoint_dir` atomically (temp file + rename); return its path."""
    path = rollout_state_path(checkpoint_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".rollout_state.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(state.to_json())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_rollout_state(checkpoint_dir: str | os.PathLike) -> RolloutState | None:
    """The state saved in `checkpoint_dir`, or None when the checkpoint has no `rollout_state.json`."""
    path = rollout_state_path(checkpoint_dir)
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    return RolloutState.from_json(text, source=str(path))


def write_rollout_pending(checkpoint_dir: str | os.PathLike, items: list) -> Path:
    """Write the untrained samples of partly trained prompts (`rollout.channel.QueuedSample`s) beside
    `rollout_state.json`, atomically; their prompts are neither done nor to be generated again."""
    path = Path(checkpoint_dir) / ROLLOUT_PENDING_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".rollout_pending.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(list(items), f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_rollout_pending(checkpoint_dir: str | os.PathLike) -> list:
    """The samples `write_rollout_pending` kept, or [] for a checkpoint without the file."""
    path = Path(checkpoint_dir) / ROLLOUT_PENDING_FILE
    try:
        with path.open("rb") as f:
            return pickle.load(f)  # our own checkpoint's file, written by write_rollout_pending
    except FileNotFoundError:
        return []
