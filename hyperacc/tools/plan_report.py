"""The dry-run plan as people and scripts read it: the printed report, the JSON report
(``--training.dry_run_report``), and the fit check against ``training.device_memory_gb``.
The plan itself is computed in `hyperacc.tools.dry_run` (re-exported there)."""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from hyperacc.tools.dry_run import ShardingPlan


def _human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(int(n))


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:9.2f} {unit}"
    return f"{n:9.0f} B"


def format_plan(plan: ShardingPlan) -> str:
    """A readable report of ``plan``; the first lines are stable for scripts to grep."""
    lines = [
        f"dry run: world_size={plan.world_size} (dp_replicate={plan.dp_replicate} x dp_shard={plan.dp_shard}"
        + (f" x cp={plan.cp}" if plan.cp > 1 else "") + (f" x tp={plan.tp}" if plan.tp > 1 else "")
        + (f"; experts: ep={plan.ep} x efsdp={plan.efsdp}" if plan.ep > 1 else "") + ")",
        f"total_params={plan.total_params} ({_human(plan.total_params)})",
        f"params_per_rank={plan.params_per_rank} ({_human(plan.params_per_rank)})",
        f"fsdp_units={plan.units} (blocks of {', '.join(plan.block_class) or 'none'} + root); "
        f"largest unit {_human(plan.largest_unit_params)} params",
        f"precision={plan.precision}; estimated bytes per rank:",
    ]
    for name, value in plan.bytes.items():
        lines.append(f"  {plan.labels.get(name, name):<78} {_bytes(value)}")
    lines.append(f"  {'device peak (larger of backward and optimizer-step phases)':<78} {_bytes(plan.device_bytes)}")
    if plan.host_bytes:
        lines.append(f"  {'host total (offloaded)':<78} {_bytes(plan.host_bytes)}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def plan_report(plan: ShardingPlan, **extra) -> dict:
    """The plan as a JSON-ready dict (``--training.dry_run_report``): world_size, cpu_offload,
    per_rank_bytes (category -> bytes), per_rank_total_bytes (the device peak), and more."""
    return {"world_size": plan.world_size, "cpu_offload": plan.host_bytes > 0, "precision": plan.precision,
            "layout": {"dp_replicate": plan.dp_replicate, "dp_shard": plan.dp_shard, "cp": plan.cp, "tp": plan.tp,
                       "ep": plan.ep, "efsdp": plan.efsdp},
            "total_params": plan.total_params, "params_per_rank": plan.params_per_rank,
            "trainable_params": plan.total_params if plan.trainable_params is None else plan.trainable_params,
            "per_rank_bytes": {k: int(v) for k, v in plan.bytes.items()},
            "per_rank_total_bytes": int(plan.device_bytes), "host_bytes_per_rank": int(plan.host_bytes),
            "notes": list(plan.notes), **extra}


def fits(plan: ShardingPlan, device_memory_gb: Optional[float]) -> Optional[bool]:
    """Whether the plan's device peak fits ``device_memory_gb`` (GB = 10^9 bytes); None when unknown."""
    return None if device_memory_gb is None else plan.device_bytes <= device_memory_gb * 1e9


def write_report(plan: ShardingPlan, path: str, *, device_type: str, device_memory_gb: Optional[float]) -> None:
    """`plan_report` as JSON at ``path`` (parents created), with the device and the fit verdict."""
    data = plan_report(plan, device_type=device_type, fits=fits(plan, device_memory_gb),
                       device_memory_bytes=None if device_memory_gb is None else int(device_memory_gb * 1e9))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2)


def check_fits(plan: ShardingPlan, device_memory_gb: Optional[float]) -> None:
    """One ValueError, naming the three largest categories and what to change, when the plan's
    device peak exceeds ``device_memory_gb``."""
    if fits(plan, device_memory_gb) is not False:
        return
    top = sorted(plan.bytes.items(), key=lambda kv: -kv[1])[:3]
    parts = ", ".join(f"{name} {value / 2**30:.1f} GiB" for name, value in top)
    raise ValueError(f"the plan needs {plan.device_bytes / 2**30:.1f} GiB per rank on {plan.world_size} rank(s) "
                     f"(largest: {parts}) but training.device_memory_gb={device_memory_gb:g} "
                     f"({device_memory_gb * 1e9 / 2**30:.1f} GiB). Fix: a leaner recipe (--fsdp.precision=bf16 or "
                     "bf16_sr), --fsdp.activation_checkpointing=true, a smaller micro-batch, more ranks, or "
                     "--fsdp.cpu_offload=true; --training.dry_run=true prints the whole plan.")
