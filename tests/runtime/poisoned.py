"""Executors whose logits row is NaN for one token: the model's output broken for one
sequence, as a test needs it (the real executor runs; only its output row is spoiled)."""

from __future__ import annotations

import numpy as np


class PoisonedRows:
    """Mixin before an executor class: a logits row whose token (the last new token of its
    sequence) is ``poison`` comes back NaN."""

    poison = -1

    def execute_numpy(self, model_input):
        logits = super().execute_numpy(model_input)
        ids = model_input.values["input_ids"]
        for row, index in enumerate(model_input.values["logits_indices"]):
            if ids[index] == self.poison:
                logits[row] = np.nan
        return logits
