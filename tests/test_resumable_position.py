"""`ResumableLoader` positions carried across another split of the same global batch (in one process:
accelerate's `prepare_data_loader` builds the shard each rank would hold)."""
import pytest
import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader

from hyperacc.data.resumable import ResumableLoader

SAMPLES = 48


def _loader(per_rank: int, processes: int, rank: int) -> ResumableLoader:
    data = DataLoader(list(range(SAMPLES)), batch_size=per_rank, shuffle=True,
                      generator=torch.Generator().manual_seed(7))
    return ResumableLoader(prepare_data_loader(data, torch.device("cpu"), num_processes=processes, process_index=rank,
                                               put_on_device=False, use_seedable_sampler=True, data_seed=3))


def _samples(batches) -> list:
    return sorted(int(x) for batch in batches for x in batch)


def test_position_moves_to_another_split_of_the_same_global_batch():
    ranks = [_loader(2, 2, r) for r in range(2)]
    iterators = [iter(r) for r in ranks]
    seen = [_samples([next(it) for _ in range(3)]) for it in iterators]    # 3 batches x 2 x 2 ranks = 12 samples
    states = [r.state_dict() for r in ranks]
    remaining_two = _samples(b for it in iterators for b in it)

    single = _loader(4, 1, 0)                  # one process, per-rank batch 4: same global batch
    single.load_state_dict(states[0])
    assert single.restored_position() == (0, 3)
    assert _samples(single) == remaining_two

    halves = _loader(2, 1, 0)                  # one process, per-rank batch 2: position in twice the batches
    halves.load_state_dict(states[0])
    assert halves.restored_position() == (0, 6)
    assert _samples(halves) == remaining_two
    assert sorted(seen[0] + seen[1] + remaining_two) == list(range(SAMPLES))


def test_a_position_that_is_no_whole_batch_is_refused():
    ranks = [_loader(2, 2, r) for r in range(2)]
    iterators = [iter(r) for r in ranks]
    for it in iterators:
        next(it)                               # 4 samples: not a whole batch of 8 (per-rank 8, 1 process)
    state = ranks[0].state_dict()
    with pytest.raises(ValueError, match="position cannot be restored exactly"):
        _loader(8, 1, 0).load_state_dict(state)
