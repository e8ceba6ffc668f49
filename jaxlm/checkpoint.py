"""Orbax checkpoints of everything a run needs to continue exactly: train state, data-iterator state, config.

Saves are asynchronous (the step loop continues while the previous checkpoint is written) and Orbax only makes a
checkpoint visible once it is complete, so the latest visible step is always restorable.
"""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data", "config"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, data_state: dict, config: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave({k: int(v) for k, v in data_state.items()}),
            config=ocp.args.JsonSave(config),
        ))

    def restore(self, step: int, abstract_state):
        """Returns (state, data_state, config_dict); `abstract_state` carries the target shardings."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
            config=ocp.args.JsonRestore(),
        ))
        return restored.state, dict(restored.data), dict(restored.config)

    def restore_config(self, step: int) -> dict:
        """Only the config saved with `step` (cheap: lets a caller check it before restoring arrays)."""
        restored = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return dict(restored.config)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
