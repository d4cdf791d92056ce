"""The analysis half of examples/loss_curves.py: curves keyed by step, their deviations from the
reference, the verdict, the table and the plot.

Split from the tool by concept: this part is pure (no training, no processes, no files except the
plot), so the tests call it on hand-written curves and ``--replot`` re-runs it on a saved run. Why
the moving average decides and what fails a curve: see examples/loss_curves.py's docstring.
"""
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

EXACT = 1e-5          # "exact": relative deviation within this (fp32 last-bit differences)


class InputError(ValueError):
    """Bad input (exit 2): an argument, a layout, or a saved curves.json. One line, with the fix."""

# ------------------------------------------------------------------ analysis
@dataclass
class Series:
    """One curve by step number (sorted), with the steps its records gave more than once."""
    steps: List[int]
    loss: List[object]
    repeated: List[int] = field(default_factory=list)

    def as_dict(self) -> Dict[int, object]:
        return dict(zip(self.steps, self.loss))


def to_series(name: str, curve) -> Series:
    """Key a curve's losses by step; a step recorded twice keeps its LAST record (a resumed run
    appends the steps after its checkpoint again: the later record is the run that continued).
    A curve whose steps are not whole numbers is bad input."""
    if not (isinstance(curve, dict) and isinstance(curve.get("step"), list) and isinstance(curve.get("loss"), list)):
        raise InputError(f"curve {name!r}: expected {{\"step\": [...], \"loss\": [...]}}.")
    steps, losses = curve["step"], curve["loss"]
    if len(steps) != len(losses):
        raise InputError(f"curve {name!r}: {len(steps)} steps but {len(losses)} losses.")
    by_step, repeated = {}, set()
    for step, loss in zip(steps, losses):
        if isinstance(step, bool) or not isinstance(step, int):
            raise InputError(f"curve {name!r}: step {step!r} is not a whole number.")
        if step in by_step:
            repeated.add(step)
        by_step[step] = loss
    order = sorted(by_step)
    return Series(order, [by_step[s] for s in order], sorted(repeated))


def is_finite(value) -> bool:
    """A real, finite number (None, strings, NaN and inf are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def format_steps(steps, limit: int = 6) -> str:
    """[1, 2, 3, 7, 9, 10] -> "1-3, 7, 9-10" (the first ``limit`` runs, then "...")."""
    runs = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    text = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit]]
    return ", ".join(text) + (", ..." if len(runs) > limit else "")


def non_finite_problem(series: Series) -> Optional[str]:
    """The first step whose loss is not a finite number, and how many such steps there are."""
    bad = [(s, v) for s, v in zip(series.steps, series.loss) if not is_finite(v)]
    if not bad:
        return None
    step, value = bad[0]
    where = format_steps([s for s, _ in bad])
    return f"the loss is {value!r} at step {step} (non-finite at {len(bad)} step(s): {where})"


def step_problems(series: Series, ref: Series) -> List[str]:
    """Steps the reference has and the layout lacks, and the reverse: never a silently shorter comparison."""
    mine, theirs = set(series.steps), set(ref.steps)
    problems = []
    if theirs - mine:
        problems.append(f"missing step(s) {format_steps(sorted(theirs - mine))} that the reference has")
    if mine - theirs:
        problems.append(f"step(s) {format_steps(sorted(mine - theirs))} that the reference lacks")
    return problems


def relative_deviation(a: float, b: float) -> float:
    """|a - b| / |b|; inf for anything not finite (so that max() and <= see it: NaN compares
    False with everything and would pass any tolerance check)."""
    if not (is_finite(a) and is_finite(b)):
        return math.inf
    if a == b:
        return 0.0
    return abs(a - b) / abs(b) if b else math.inf


def deviation(curve: list, reference: list) -> list:
    return [relative_deviation(a, b) for a, b in zip(curve, reference)]


def moving_average(values: list, window: int) -> list:
    """The mean of the last ``window`` values at each step (fewer at the start). Finite values only:
    one NaN would stay in the running total for good."""
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


@dataclass
class Row:
    """One layout's result: either problems (cannot be compared) or its deviations."""
    name: str
    problems: List[str] = field(default_factory=list)
    repeated: List[int] = field(default_factory=list)
    exact: int = 0                  # leading steps within EXACT
    max_dev: float = 0.0
    max_dev_step: Optional[int] = None
    smooth: float = math.nan        # largest deviation of the moving average (NaN until computed: fails)
    tail_mean: float = math.nan


def compare(name: str, series: Series, ref: Series, window: int, ref_ok: bool) -> Row:
    """Compare one layout with the reference step by step (the curves are aligned by step)."""
    row = Row(name, repeated=series.repeated)
    row.problems = [p for p in [non_finite_problem(series)] if p] + step_problems(series, ref)
    if not series.steps and not row.problems:
        row.problems.append("no steps recorded")
    if row.problems or not ref_ok:
        return row
    dev = deviation(series.loss, ref.loss)      # same steps in the same order: step_problems() found none
    smooth = deviation(moving_average(series.loss, window), moving_average(ref.loss, window))
    row.exact = next((i for i, d in enumerate(dev) if not d <= EXACT), len(dev))
    at = max(range(len(dev)), key=dev.__getitem__)
    row.max_dev, row.max_dev_step, row.smooth = dev[at], series.steps[at], max(smooth)
    tail = series.loss[-window:]
    row.tail_mean = sum(tail) / len(tail)
    return row


def reference_row(name: str, ref: Series, window: int, expected: Optional[int]) -> Row:
    """The reference's own problems: non-finite losses, no steps, or missing some of the steps
    1..expected that the run was asked for (the layouts are only checked against the reference)."""
    row = Row(name, repeated=ref.repeated)
    problem = non_finite_problem(ref)
    if problem:
        row.problems.append(problem)
    if not ref.steps:
        row.problems.append("no steps recorded")
    if expected:
        missing = sorted(set(range(1, expected + 1)) - set(ref.steps))
        if missing:
            row.problems.append(f"missing step(s) {format_steps(missing)} of the {expected} the run was asked for")
    if not row.problems:
        tail = ref.loss[-window:]
        row.smooth, row.tail_mean = 0.0, sum(tail) / len(tail)
    return row


def analyse(curves: dict, reference: str, window: int, expected: Optional[int] = None) -> List[Row]:
    """Rows for the reference (first) and every other layout; pure (no I/O) so that tests can call it."""
    series = {name: to_series(name, curve) for name, curve in curves.items()}
    ref = series[reference]
    rows = [reference_row(reference, ref, window, expected)]
    ref_ok = not rows[0].problems
    rows += [compare(name, s, ref, window, ref_ok) for name, s in series.items() if name != reference]
    return rows


def passed(rows: List[Row], tolerance: float) -> bool:
    """True only when no curve has a problem and every moving-average deviation is a finite number
    within the tolerance (written so that a NaN fails)."""
    return all(not row.problems and math.isfinite(row.smooth) and row.smooth <= tolerance for row in rows)


# ------------------------------------------------------------------ reporting
def plot(curves: dict, reference: str, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install hyperacc[plot])")
        return False
    series = {name: to_series(name, curve) for name, curve in curves.items()}
    ref = series[reference].as_dict()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, s in series.items():
        top.plot(s.steps, [v if is_finite(v) else math.nan for v in s.loss], label=name, linewidth=1)
        if name != reference:
            points = [(step, relative_deviation(v, ref.get(step))) for step, v in zip(s.steps, s.loss)]
            points = [(step, max(d, 1e-12)) for step, d in points if math.isfinite(d)]
            bottom.semilogy([p[0] for p in points], [p[1] for p in points], label=name, linewidth=1)
    top.set_ylabel("loss")
    top.set_title(f"loss per step, every layout (reference: {reference})")
    top.legend(fontsize=8)
    bottom.set_ylabel(f"|loss - loss[{reference}]| / loss[{reference}]")
    bottom.set_xlabel("optimizer step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def report(rows: List[Row], window: int, tolerance: float) -> bool:
    """Print the table, every problem, and the verdict; returns whether it passed."""
    print(f"\n| layout | exact (within 1e-5) for | max rel. loss deviation (at step) | max rel. deviation of "
          f"the {window}-step moving average | last {window} steps' mean loss |")
    print("|---|---|---|---|---|")
    for i, row in enumerate(rows):
        label = f"{row.name} (reference)" if i == 0 else row.name
        if row.problems:
            print(f"| {label} | FAILED: {'; '.join(row.problems)} | | | |")
        elif i == 0:
            print(f"| {label} | — | — | — | {row.tail_mean:.4f} |")
        elif row.max_dev_step is None:
            print(f"| {label} | not compared: the reference cannot be | | | |")
        else:
            print(f"| {label} | {row.exact} steps | {row.max_dev:.1e} ({row.max_dev_step}) | {row.smooth:.1e} | "
                  f"{row.tail_mean:.4f} |")
    print()
    for row in rows:
        if row.repeated:
            print(f"note: {row.name}: step(s) {format_steps(row.repeated)} recorded more than once; "
                  "the last record of each is compared")
    failed = [row for row in rows if row.problems]
    for row in failed:
        print(f"FAILED {row.name}{' (the reference)' if row is rows[0] else ''}: {'; '.join(row.problems)}")
    if failed:
        print(f"FAILED: {len(failed)} curve(s) cannot be compared (above)")
        return False
    worst = max((row.smooth for row in rows[1:]), default=0.0)
    ok = passed(rows, tolerance)
    print(f"largest moving-average deviation {worst:.2e}: {'within' if ok else 'BEYOND'} the tolerance {tolerance:g}")
    return ok
