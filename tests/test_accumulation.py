"""Issue 3: exact token-weighted gradient accumulation, in step mode and accelerate mode."""
import json

import pytest
import torch

import hyperacc
from dist_utils import REPO, run_python, run_together, run_torchrun
from hyperacc.data.collate import pad_collate
from hyperacc.models import build_causal_lm, qwen3_moe_config

SCRIPT = REPO / "tests" / "scripts" / "train_tiny.py"
STEPS = 20


def _rel(a, b):
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def _run(tmp_path, name, nproc, *extra):
    out = tmp_path / f"{name}.json"
    args = [out, *ACCUMULATION_ARGS, *extra]
    if nproc == 1:
        run_python(SCRIPT, args)
    else:
        run_torchrun(SCRIPT, nproc, args)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """1 process x 4 micro-batches beside 2 processes x 2 micro-batches (run_together: independent,
    deterministic runs), and the full gradients of each one's first step; one launch of each serves the
    consistency matrix and the padded-gradients check."""
    one, two = tmp_path_factory.mktemp("ref"), tmp_path_factory.mktemp("2x2")
    return run_together(lambda: (_run(one, "one", 1, "--grads", one / "grads1.pt"), one / "grads1.pt"),
                        lambda: (_run(two, "2x2", 2, "--grads", two / "grads2.pt"), two / "grads2.pt"))


@pytest.fixture(scope="module")
def reference(jobs):
    return jobs[0]


@pytest.fixture(scope="module")
def two_by_two(jobs):
    return jobs[1]


@pytest.mark.parametrize("name,nproc,extra,micro", [   # recompute: also tests/test_router_aux.py (dp2 mb2)
    # 2x2 by default: tests/test_core.py::test_token_weighted_accumulation_2x2_matches_1x4 (its shared launch)
    pytest.param("2x2", 2, [], 2, marks=pytest.mark.slow),
    pytest.param("4x1", 4, [], 1, marks=pytest.mark.slow),
    pytest.param("2x2_recompute", 2, ["--recompute"], 2, marks=pytest.mark.slow),
    pytest.param("2x2_reduce_every", 2, ["--reduce-every"], 2, marks=pytest.mark.slow),
])
def test_consistency_matrix(reference, request, tmp_path, name, nproc, extra, micro):
    ref, _ = reference
    run = request.getfixturevalue("two_by_two")[0] if name == "2x2" else _run(tmp_path, name, nproc, *extra)
    check_accumulation(ref, run, micro)


# The default run's exact token-weighted accumulation checks ride tests/test_core.py's launches (the same
# train_tiny.py runs, --then): test_core.py::test_token_weighted_accumulation_2x2_matches_1x4 and
# ::test_padded_gradients_equal_one_big_batch; this file's own launches are slow.
ACCUMULATION_ARGS = ["--steps", STEPS, "--pad", "--clip", "1e9"]       # + --grads PATH


def check_accumulation(ref, run, micro):
    """``run`` (``micro`` micro-batches per rank and step) trains as ``ref`` (1 process x 4 micro-batches)."""
    assert ref["micro_batches"] == 4 and len(ref["losses"]) == STEPS
    assert run["micro_batches"] == micro
    assert _rel(ref["losses"], run["losses"]) <= 1e-5
    assert _rel(ref["grad_norms"], run["grad_norms"]) <= 1e-4
    assert run["tokens"] == ref["tokens"]


@pytest.mark.slow   # by default: tests/test_core.py::test_padded_gradients_equal_one_big_batch
def test_padded_gradients_equal_one_big_batch(reference, two_by_two):
    """Unequal valid tokens per micro-batch and rank: grads == single-process token-mean grads (the
    first step's gradients of the 1-process and the 2-process runs)."""
    check_padded_gradients(reference[1], two_by_two[1])


def check_padded_gradients(grads_one_proc, grads_path):
    """The first step's full gradients saved at both paths equal one big batch's token-mean gradients."""
    import sys
    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    from train_tiny import DATASET_SIZE, TokenDataset

    loader = hyperacc.MicroBatchDataLoader(TokenDataset(DATASET_SIZE, pad=True), global_batch_size=8,
                                           micro_batch_size=8, collate_fn=pad_collate, seed=3)
    (big_batch,) = next(iter(loader))
    counts = (big_batch["labels"][:, 1:] != -100).sum(dim=1)
    assert len(set(counts.tolist())) > 2, "the test needs unequal token counts"
    model = build_causal_lm(qwen3_moe_config(), seed=7, router_aux_loss=False)
    model(**big_batch).loss.backward()
    for path in (grads_path, grads_one_proc):
        grads = torch.load(path, weights_only=True)
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)


# --------------------------------------------------------------------------- in-process
@pytest.fixture(scope="module")
def acc():
    accelerator = hyperacc.Accelerator(checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=7)
    yield accelerator
    accelerator.end_training()


def _batch(n, seq=16, valid=None):
    ids = torch.randint(0, 512, (n, seq), generator=torch.Generator().manual_seed(n))
    labels = ids.clone()
    if valid is not None:
        labels[:, valid:] = -100
    return {"input_ids": ids, "labels": labels}


def test_accelerate_mode_matches_plain_loop(acc):
    """gradient_accumulation_steps=k: loss/k, sync every k-th micro-step and at the loader's end."""
    k = 2
    data = [_batch(2 + i % 2) for i in range(7)]  # 7 micro-steps: syncs after 2, 4, 6 and 7

    reference = build_causal_lm(qwen3_moe_config(), seed=11, router_aux_loss=False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_losses = []
    for index, batch in enumerate(data):
        loss = reference(**batch).loss
        (loss / k).backward()
        ref_losses.append(float(loss))
        if (index + 1) % k == 0 or index == len(data) - 1:
            ref_opt.step()
            ref_opt.zero_grad()

    acc.gradient_accumulation_steps = k
    try:
        model = build_causal_lm(qwen3_moe_config(), seed=11, router_aux_loss=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        loader = torch.utils.data.DataLoader(data, batch_size=None, shuffle=False)
        model, optimizer, loader = acc.prepare(model, optimizer, loader)
        losses, syncs = [], []
        for batch in loader:
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                losses.append(float(loss))
                syncs.append(acc.sync_gradients)
                optimizer.step()
                optimizer.zero_grad()
    finally:
        acc.gradient_accumulation_steps = 1
    assert syncs == [False, True, False, True, False, True, True]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_batch_without_labels(acc):
    model = acc.prepare(build_causal_lm(qwen3_moe_config()))
    with pytest.raises(KeyError, match="no 'labels'"):
        with acc.accumulate(model, [{"input_ids": torch.zeros(1, 4, dtype=torch.long)}]):
            pass
    with pytest.raises(TypeError, match="non-empty list of micro-batch"):
        with acc.accumulate(model, []):
            pass


def test_zero_valid_tokens_with_nonzero_loss(acc):
    model = acc.prepare(build_causal_lm(qwen3_moe_config()))
    batch = _batch(2, valid=1)  # after the causal shift no label is valid
    with pytest.raises(ValueError, match="no valid label tokens"):
        with acc.accumulate(model, [batch]) as micro_batches:
            for mb in micro_batches:
                acc.backward(torch.tensor(1.0, requires_grad=True))


def test_backward_outside_accumulate_with_micro_batches():
    acc = hyperacc.Accelerator(checkpoint=hyperacc.CheckpointConfig(save_ckpt=False))
    model = build_causal_lm(qwen3_moe_config())
    loader = hyperacc.MicroBatchDataLoader([_batch(1, 8) for _ in range(8)], global_batch_size=4,
                                           micro_batch_size=1,
                                           collate_fn=lambda s: {k: torch.cat([x[k] for x in s]) for k in s[0]})
    model, loader = acc.prepare(model, loader)
    mb = next(iter(loader))[0]
    with pytest.raises(RuntimeError, match="outside `with acc.accumulate"):
        acc.backward(model(**mb).loss)


def test_the_accumulator_owns_the_sync_flag(acc):
    """Step mode: the accumulator sets sync_gradients (False but on a step's last micro-batch) and is
    what the step-mode scheduler reads; accelerate's GradientState, which accelerate's optimizer wrapper,
    `acc.sync_gradients` and transformers' Trainer use, answers the same at every point."""
    from accelerate.state import GradientState

    from hyperacc.sharding.rebind import PreparedScheduler

    model = build_causal_lm(qwen3_moe_config(), seed=5, router_aux_loss=False)
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    scheduler = PreparedScheduler(torch.optim.lr_scheduler.StepLR(optimizer.optimizer, 1, gamma=0.5), [optimizer],
                                  acc.accumulator)
    flags, changed = [], []
    with acc.accumulate(model, [_batch(2), _batch(3), _batch(2)]) as micro_batches:
        for mb in micro_batches:
            flags.append((acc.accumulator.sync_gradients, acc.sync_gradients, GradientState().sync_gradients))
            acc.backward(model(**mb).loss)
            weights = [p.detach().full_tensor().clone() for p in model.parameters()]
            optimizer.step()          # accelerate's wrapper: a no-op while the flag it reads is False
            scheduler.step()          # reads the accumulator: the same
            changed.append(any(not torch.equal(w, p.detach().full_tensor()) for w, p in zip(weights, model.parameters())))
    assert flags == [(False, False, False), (False, False, False), (True, True, True)]
    assert changed == [False, False, True] and scheduler.get_last_lr() == [0.5]   # one update, one schedule step
    assert acc.accumulator.sync_gradients and acc.sync_gradients and GradientState().sync_gradients
    optimizer.zero_grad()
    acc.gradient_accumulation_steps = 2           # accelerate mode: accelerate decides, the accumulator reads it
    try:
        seen = []
        for _ in range(2):
            with acc.accumulate(model):
                seen.append((acc.accumulator.sync_gradients, acc.sync_gradients))
        assert seen == [(False, False), (True, True)]
    finally:
        acc.gradient_accumulation_steps = 1
        acc.step = 0
