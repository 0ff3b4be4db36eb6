"""With torch imported, the RNG state saved with a checkpoint includes torch's CPU
generator, and restoring it repeats torch's draws (run by `make test-torch`)."""

from __future__ import annotations

import numpy as np
import torch
from ortckpt import CheckpointManager, CheckpointState, capture_rng_state, restore_rng_state


def test_torch_generator_state_round_trips_through_a_checkpoint(tmp_path):
    torch.manual_seed(7)
    torch.rand(5)  # anywhere in the stream, not just at a seed
    manager = CheckpointManager(tmp_path)
    manager.save(CheckpointState.from_arrays({"w": np.zeros(3, np.float32)}), 1, rng_state=capture_rng_state())
    assert "torch" in manager.latest().rng_state
    expected = torch.rand(8)
    torch.rand(100)
    restore_rng_state(CheckpointManager(tmp_path, read_only=True).latest().rng_state)
    assert torch.equal(torch.rand(8), expected)
