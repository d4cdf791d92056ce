"""When to save: ``save_steps``, ``save_epochs``, the end of training, at most once per step.

Pure bookkeeping, no I/O: the Checkpointer asks after every optimizer step and at the end.
``save_ckpt`` governs writing and ``restore_from`` reading, independently:

==========  =============  ==================================================================
save_ckpt   restore_from   behaviour
==========  =============  ==================================================================
False       None           nothing is read or written (no directory is created)
True        None           fresh start; saves by the cadence below and at the end
False       set            resumes from the checkpoint; never writes
True        set            resumes, then keeps saving (a resume that trains no further step
                           does not save the restored step again)
==========  =============  ==================================================================
"""
from __future__ import annotations

from typing import Optional


class SavePolicy:
    def __init__(self, save_ckpt: bool, save_steps: int, save_epochs: int):
        self.save_ckpt = bool(save_ckpt)
        self.save_steps = int(save_steps)
        self.save_epochs = int(save_epochs)
        self.last_saved_step: Optional[int] = None
        self.epoch_seen: Optional[int] = None

    def note_saved(self, step: int) -> None:
        self.last_saved_step = int(step)

    def note_restored(self, step: int, epoch: int) -> None:
        """After a resume the restored step counts as saved and its epoch as already seen."""
        self.last_saved_step = int(step)
        self.epoch_seen = int(epoch)

    def step_end(self, step: int, epoch: int) -> Optional[str]:
        """Why to save after optimizer step ``step`` now at ``epoch`` (None: don't)."""
        previous = 0 if self.epoch_seen is None else self.epoch_seen
        self.epoch_seen = int(epoch)
        if not self.save_ckpt or step == self.last_saved_step:
            return None
        reasons = []
        if self.save_steps and step > 0 and step % self.save_steps == 0:
            reasons.append(f"save_steps={self.save_steps}")
        if self.save_epochs and any(e % self.save_epochs == 0 for e in range(previous + 1, epoch + 1)):
            reasons.append(f"epoch {epoch} ended (save_epochs={self.save_epochs})")
        return " and ".join(reasons) or None

    def final_needed(self, step: int) -> bool:
        return self.save_ckpt and step != self.last_saved_step
