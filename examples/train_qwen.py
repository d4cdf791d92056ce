"""Pre-train Qwen3-MoE with hyperacc: from a tiny model on 2 CPU processes to Qwen3-30B-A3B on 8 NPUs.

    accelerate launch --config_file accelerate_configs/cpu_fsdp2_2proc.yaml examples/train_qwen.py
    accelerate launch --config_file accelerate_configs/fsdp2_8npu.yaml examples/train_qwen.py \
        examples/configs/qwen3_30b_a3b.yaml
    python examples/train_qwen.py examples/configs/qwen3_30b_a3b.yaml --training.dry_run=true
    accelerate launch --config_file accelerate_configs/cpu_fsdp2_2proc.yaml examples/train_qwen.py \
        --model.name_or_path=PRETRAINED_DIR --peft.method=lora --peft.export_dir=adapter   # LoRA fine-tuning

Usage: train_qwen.py [CONFIG.yaml] [--section.field=value ...]   (--help lists every field)
Without a YAML it trains the embedded default: a tiny Qwen3-MoE on the offline corpus/tokenizer.
Rank 0 prints the step lines and ends with a summary (steps, loss, where the metrics, checkpoints and
the resolved config went, what to try next); ``--verbose`` (= --training.verbose=true) also prints
the resolved config at the start (examples/run_summary.py).
A bad setting -- including a resume whose data, schedule, fine-tuning setup or model differ from the
checkpoint's (--data.resume_mismatch=restart accepts other data) -- stops before anything is built:
one `config error:` line, exit 2.
The library does the hard parts (sharding, exact accumulation, checkpoints, metrics); the loop
below is all there is to the training itself.
"""
import datetime
import os
import sys
import time

STARTED = time.monotonic()     # the summary's wall time counts the imports too

import yaml  # noqa: E402

# Make `import hyperacc` (and the schema beside this file) work from a source checkout.
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

from config_checks import check_model_dtype, check_paths, check_peft_installed, check_peft_layout, check_switches  # noqa: E402
from config_checks import MIN_TRANSFORMERS_TP_EP, check_transformers_for_tp_ep, optimizer_config  # noqa: E402,F401 - tests use them from here
from config_schema import TrainConfig, check_batch  # noqa: E402
from exit_report import exit_with  # noqa: E402
from lora_setup import export_peft  # noqa: E402
from model_setup import build_model, model_config  # noqa: E402,F401 - tests patch build_model here
from preflight_checks import dry_run, memory_plan, preflight  # noqa: E402,F401
from resume_checks import check_checkpoint_start  # noqa: E402,F401 - tests use it from here
from run_summary import SummarySink, announce, summary  # noqa: E402
from hyperacc.tools.cli_config import ConfigError, config_file, dump_config, format_config, given_keys, parse_config  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "qwen3_moe_tiny.yaml")


def load_config(argv):
    """Parse and check the config; every problem is one ConfigError, before anything heavy.

    Without a config file argument the embedded default (configs/qwen3_moe_tiny.yaml) is used. The
    positional argument is the config file whatever its suffix (``my_config``, ``cfg.txt``): it is read
    as YAML, and one that is missing or does not parse is named in the error.
    """
    argv = ["--training.verbose=true" if arg == "--verbose" else arg for arg in argv]   # the short form
    config_path = config_file(TrainConfig, argv)
    cfg = parse_config(TrainConfig, None if config_path else DEFAULT_CONFIG, argv=argv)
    check_switches(cfg, given_keys(TrainConfig, None if config_path else DEFAULT_CONFIG, argv))
    check_model_dtype(cfg)
    check_peft_installed(cfg)
    check_peft_layout(cfg)
    check_paths(cfg, config_path or DEFAULT_CONFIG)
    t, p = cfg.training, cfg.parallel
    world = t.dry_run_world_size if t.dry_run else None
    world = world or int(os.environ.get("WORLD_SIZE", "0")) or (8 if t.dry_run else 1)
    check_batch(t, world // (max(1, p.tp_size) * max(1, p.cp_size)))
    return cfg, world


def build_data(cfg, acc, tokenizer):
    """(train dataset, held-out dataset or None, collate_fn, transform) via hyperacc.data.text or, for chat
    data, hyperacc.data.chat_dataset (padded or packed micro-batches). ``data.streaming``: the train data is
    a stream (hyperacc.data.stream_sources) and ``transform`` makes its records into samples as they are read.

    Rank 0 tokenizes and fills the cache first, then the others read it. A failure on any rank
    (a hub dataset not in the cache, an unreadable file ...) is every rank's ConfigError.
    """
    from hyperacc.data.chat_dataset import build_chat_dataset, chat_collate
    from hyperacc.data.text import build_train_dataset
    from hyperacc.training import raise_if_any_rank_failed

    d = cfg.data
    if not (acc.is_main_process and sys.stderr.isatty()):   # tokenizing bars: rank 0's, on a terminal (as the
        import datasets                                      # training bar: in a log, redraws are noise)

        datasets.disable_progress_bars()

    def dataset(split):
        if d.format == "chat":
            return build_chat_dataset(d.dataset, tokenizer, seq_len=d.seq_len, split=split, name=d.name,
                                      messages_column=d.messages_column, num_proc=d.num_proc)
        return build_train_dataset(d.dataset, tokenizer, split=split, seq_len=d.seq_len, name=d.name,
                                   text_column=d.text_column, num_proc=d.num_proc)[0]

    def build():
        transform = None
        if d.streaming:
            from hyperacc.data import ChatRecords, TextWindows
            from hyperacc.data.stream_sources import open_stream

            train_ds = open_stream(d.dataset, kind=d.format, name=d.name, split=d.split)
            transform = (ChatRecords(tokenizer, d.seq_len, messages_column=d.messages_column) if d.format == "chat"
                         else TextWindows(tokenizer, d.seq_len, text_column=d.text_column))
        else:
            train_ds = dataset(d.split)
        eval_ds = dataset(d.eval_split or "validation") if cfg.eval.eval_steps else None
        collate = chat_collate(tokenizer, packing=d.packing) if d.format == "chat" else None
        return train_ds, eval_ds, collate, transform

    result = None
    for turn in ("first", "rest"):           # rank 0's turn, then everyone else's
        error = None
        if acc.is_main_process == (turn == "first"):
            try:
                result = build()
            except Exception as err:  # noqa: BLE001 - agreed below, re-raised on every rank
                error = err
        raise_if_any_rank_failed(error, group=acc.runtime.cpu_group, what="building the data")
    return result


def train(cfg, tokenizer):
    import torch
    from accelerate.utils import InitProcessGroupKwargs

    import hyperacc

    t = cfg.training
    validate = t.mode == "validate"
    if validate:   # reproducible kernels (cuBLAS needs a fixed workspace); warnings where none exist
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)

    aux = cfg.model.router_aux_loss
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=t.collective_timeout_s))
    acc = hyperacc.Accelerator(parallel=cfg.parallel, fsdp=cfg.fsdp, checkpoint=cfg.checkpoint, seed=t.seed,
                               router_aux_loss=aux if aux in ("sequence", "micro_batch") else None,
                               kwargs_handlers=[timeout])
    # From here on, a collective that times out (a rank died or hangs: in the data, prepare, load_state,
    # the loop or the final save) becomes one line naming the silent rank(s) and what they were doing.
    with acc.runtime.heartbeat.watching():
        return run_job(cfg, tokenizer, acc)


def run_job(cfg, tokenizer, acc):
    """Everything after the Accelerator: data, model, resume, the loop, the final save."""
    import hyperacc
    from hyperacc.sharding.compile import CompileWatch
    from hyperacc.training.metrics import MetricsLogger, PeriodicCleanup
    from hyperacc.errors import NonFiniteError, TokenIdError
    from hyperacc.training import check_same_config, evaluate, lr_lambda_scheduler, param_groups
    from hyperacc.training.step_checks import StepChecks

    t, heartbeat = cfg.training, acc.runtime.heartbeat
    validate = t.mode == "validate"
    heartbeat.phase = "starting"
    check_same_config(dump_config(cfg), group=acc.runtime.cpu_group)   # every node launched alike
    if t.verbose:
        acc.print(format_config(cfg))
    # Written atomically into each checkpoint, and as <checkpoint_dir>/config.yaml once a resume is accepted.
    acc.set_run_config(yaml.safe_dump(dump_config(cfg), sort_keys=False))

    # Data, model, optimizer, schedule.
    heartbeat.phase = "building the data"
    train_ds, eval_ds, collate, transform = build_data(cfg, acc, tokenizer)
    heartbeat.phase = "prepare"
    model = build_model(cfg, vocab_size=len(tokenizer), accelerator=acc)
    if cfg.peft.method != "none":
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        acc.print(f"peft: {cfg.peft.method} r={cfg.peft.r} alpha={cfg.peft.alpha:g} on "
                  f"{','.join(cfg.peft.target_modules)}: {trainable:,} trainable of {total:,} parameters "
                  f"({100 * trainable / max(total, 1):.2f} %)")
    optimizer = optimizer_config(cfg).build(param_groups(model, cfg.optimizer.get("weight_decay", 0.0)))
    scheduler = lr_lambda_scheduler(optimizer, cfg.lr_scheduler, cfg.lr_scheduler.total_steps or t.max_steps)
    batches = dict(global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size, collate_fn=collate,
                   shuffle=cfg.data.shuffle, seed=t.seed, resume_mismatch=cfg.data.resume_mismatch)
    loader = (hyperacc.StreamingDataLoader(train_ds, transform=transform, window=cfg.data.stream_window,
                                           bad_rows=cfg.data.bad_rows, **batches) if cfg.data.streaming
              else hyperacc.MicroBatchDataLoader(train_ds, **batches))
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    model.train()
    heartbeat.phase = "load_state"
    if acc.load_state() is not None:          # checkpoint.restore_from: a path or LATEST
        acc.print(f"resumed at step {acc.progress.global_step} (epoch {acc.progress.epoch})")
    last_saved = acc.progress.global_step     # a resumed step counts as saved
    # The resolved config to its file, now that the start is accepted, and one line saying where (rank 0).
    config_path = announce(cfg, acc.checkpoint_config.checkpoint_dir, acc.num_processes) if acc.is_main_process else None
    heartbeat.phase = "training"

    # Metrics, housekeeping, checks: step hooks, run by optimizer.step() and acc.step_end() in a fixed order
    # (hyperacc.training.hooks: checks before the update; guard, compile watch, metrics, cleanup, eval, save).
    log, outcome = cfg.logging, SummarySink()
    metrics = MetricsLogger(metrics_file=log.metrics_file, logging_steps=log.logging_steps,
                            tensorboard_dir=log.tensorboard_dir, progress_bar=log.progress_bar,
                            max_steps=t.max_steps, initial_step=acc.progress.global_step,
                            group=acc.runtime.cpu_group, device_type=acc.runtime.device_type,
                            consumed_tokens=acc.progress.consumed_tokens,
                            consumed_samples=acc.progress.consumed_samples,
                            flush_on=(NonFiniteError, TokenIdError, hyperacc.ReplicaMismatchError),
                            sinks=[outcome])
    cleanup = PeriodicCleanup(t.gc_steps, t.empty_cache_steps, acc.runtime.device_type)
    # Non-finite steps stop the job: checked on logging steps and before every save (validate: every step).
    checks = StepChecks(acc, validate=validate, check_every=log.logging_steps)
    # Copies that must agree (HSDP replicas, whole parameters, step, loss) are compared every N steps
    # and before every save (validate: every step).
    guard = hyperacc.ReplicaGuard(acc, every=1 if validate else t.replica_check_steps)
    max_norm = t.gradient_clipping or float("inf")
    compiles = CompileWatch(acc.fsdp_config.compile, warmup_steps=acc.progress.global_step + 2)
    eval_every = cfg.eval.eval_steps if eval_ds is not None else 0

    def run_eval(step):
        result = evaluate(acc, model, eval_ds, batches=cfg.eval.eval_batches,
                          batch_size=cfg.eval.eval_batch_size or t.micro_batch_size, collate_fn=collate)
        metrics.log_eval(step=step, loss=result["loss"])

    def eval_hook(state):                      # a step hook: after the metrics record, before the save
        if eval_every and state.step % eval_every == 0:
            run_eval(state.step)

    for hook in (checks, guard, compiles, metrics, cleanup, eval_hook):
        acc.add_step_hook(hook)

    # The loop: one loader item = the micro-batches of one optimizer step.
    step = acc.progress.global_step
    acc.wait_for_everyone()                    # step 1's time must not include another rank's start-up
    with metrics:                              # flushed on a non-finite stop
        metrics.start()
        while step < t.max_steps and loader.epoch < t.epochs:
            for batch in loader:
                with acc.accumulate(model, batch) as micro_batches:   # token ids checked here, on every rank
                    for mb in micro_batches:
                        outputs = model(**mb)
                        acc.backward(outputs.loss, aux_loss=getattr(outputs, "aux_loss", None))
                acc.clip_grad_norm_(model.parameters(), max_norm)     # the hooks read the norm (no host read)
                optimizer.step()                       # the step checks run first: nothing non-finite is applied
                scheduler.step()
                optimizer.zero_grad()
                if acc.step_end():                     # the hooks, in order; True: saved (checkpoint.save_steps
                    last_saved = acc.progress.global_step    # / save_epochs), the step's metrics flushed
                step = acc.progress.global_step
                if step >= t.max_steps:
                    break

        checks.verify()                            # the steps since the last check
        if step < t.max_steps:
            per_epoch = "" if cfg.data.streaming else f" of {len(loader)} steps"
            acc.print(f"the data ran out after training.epochs={t.epochs} epoch(s){per_epoch}: "
                      f"stopped at step {step} < training.max_steps={t.max_steps}")
        if eval_every and step % eval_every != 0:
            run_eval(step)                         # the final evaluation
        if compiles.enabled:
            acc.print(compiles.summary())
    cleanup.close()
    if cfg.peft.export_dir or cfg.peft.merged_export_dir:
        if cfg.checkpoint.save_ckpt and step > last_saved:
            heartbeat.phase = "the final save"
            acc.save_state()                   # first: an export that fails then costs no training
        heartbeat.phase = "the PEFT exports"
        export_peft(cfg, acc, model, tokenizer)
    heartbeat.phase = "the final save"
    main_process, checkpoint_dir = acc.is_main_process, acc.checkpoint_config.checkpoint_dir
    acc.end_training()                         # final save per the policy, process group down
    if main_process:
        print("\n".join(summary(cfg, outcome, checkpoint_dir=checkpoint_dir, config_path=config_path,
                                started=STARTED)), flush=True)


def main(argv=None):
    from hyperacc.errors import (CheckpointDirInUse, CheckpointDirLocked, CheckpointDirNotShared, CollectiveTimeout,
                                 DataResumeMismatch, NonFiniteError, ReplicaMismatchError, StreamRowError,
                                 TokenIdError)

    try:
        cfg, world = load_config(sys.argv[1:] if argv is None else argv)
        if cfg.training.dry_run:
            return dry_run(cfg, world)
        tokenizer = preflight(cfg, world)
        return train(cfg, tokenizer)
    except (ConfigError, CheckpointDirLocked, CheckpointDirNotShared, CheckpointDirInUse,
            DataResumeMismatch, StreamRowError) as err:   # the last two: data preflight cannot see (a file changed
        # in place: resume_checks.py; a malformed record mid-stream: --data.bad_rows)
        exit_with("config error", err, 2)
    except (NonFiniteError, TokenIdError, ReplicaMismatchError) as err:
        exit_with("error", err, 3)
    except CollectiveTimeout as err:
        exit_with("error", err, 4)


if __name__ == "__main__":
    main()
