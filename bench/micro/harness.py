"""The one timing harness of bench/micro/: clocks, a timer with warm-up, interleaved A/B rounds,
medians and a ratio table.

Not a benchmark itself. Every script in bench/micro/ imports it by its bare name (`from harness
import ...`): run a micro-benchmark as a file, `python bench/micro/X.py`, and Python puts
bench/micro/ first on sys.path. It is the only import between bench scripts (bench/README.md).

The machines these run on are shared and drift from one minute to the next, so:
- arms of an A/B run interleaved, round after round, the order reversed every other round
  (`interleaved`), and each arm keeps its median or its best round (other load only ever adds
  time, so the best is the least disturbed);
- `--clock cpu` (`add_clock_arg`) counts the process's CPU seconds instead of the wall clock:
  with one thread (OMP_NUM_THREADS=1) that is the work itself, whatever else the machine runs;
  with more threads it would also count the workers' spinning.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TypeVar

T = TypeVar("T")

# wall: elapsed time; cpu: this process's CPU time (all threads); thread: this thread's CPU time
CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    "cpu": time.process_time,
    "thread": time.thread_time,
}


def add_clock_arg(parser: argparse.ArgumentParser, default: str = "wall",
                  choices: Iterable[str] = ("wall", "cpu")) -> None:
    """--clock wall|cpu (the name; CLOCKS[name] is the function)."""
    parser.add_argument("--clock", choices=tuple(choices), default=default,
                        help="wall: elapsed time; cpu: the process's CPU time "
                             "(with OMP_NUM_THREADS=1: the work, whatever else runs)")


def samples(fn: Callable[[], object], repeat: int, *, reps: int = 1, warmup: int = 1,
            clock: Callable[[], float] = time.perf_counter,
            sync: Callable[[], object] | None = None) -> list[float]:
    """Seconds per call of fn: `warmup` calls first, then `repeat` samples, each `reps` calls
    timed together (sync(), e.g. torch.cuda.synchronize, before and after each sample)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        if sync is not None:
            sync()
        start = clock()
        for _ in range(reps):
            fn()
        if sync is not None:
            sync()
        out.append((clock() - start) / reps)
    return out


def measure(fn: Callable[[], object], repeat: int, *, stat=statistics.median, **kw) -> float:
    """stat (median by default; min for the best) of `samples(fn, repeat, **kw)`, seconds."""
    return stat(samples(fn, repeat, **kw))


def reps_for(fn: Callable[[], object], budget_s: float,
             clock: Callable[[], float] = time.perf_counter) -> int:
    """Calls of fn that take about budget_s (one warm-up call, one timed call)."""
    fn()
    start = clock()
    fn()
    return max(1, int(budget_s / max(clock() - start, 1e-6)))


def interleaved(arms: Mapping[str, T], rounds: int) -> Iterator[tuple[int, str, T]]:
    """(round, name, arm) for every arm in every round, the order reversed every other round
    (the machine drifts)."""
    items = list(arms.items())
    for r in range(rounds):
        for name, arm in items if r % 2 == 0 else items[::-1]:
            yield r, name, arm


def ab_rounds(arms: Mapping[str, Callable[[], object]], rounds: int, *,
              clock: Callable[[], float] = time.perf_counter, budget_s: float = 0.02,
              stat=min) -> dict[str, float]:
    """Seconds per call of each arm: per round, calls sized to about budget_s per arm, the
    rounds interleaved across the arms; stat (the best round by default) over the rounds."""
    reps = {name: reps_for(fn, budget_s, clock) for name, fn in arms.items()}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _, name, fn in interleaved(arms, rounds):
        times[name] += samples(fn, 1, reps=reps[name], warmup=0, clock=clock)
    return {name: stat(t) for name, t in times.items()}


def ratio_table(rows: Iterable[tuple[str, float]], *, base: str | None = None, unit: str = "ms",
                scale: float = 1e3, ratio: str = "x base", width: int = 24) -> None:
    """Prints one line per (name, seconds): the time in unit (seconds x scale) and its ratio
    to the base row (the first row unless named): time / base's time."""
    rows = list(rows)
    ref = dict(rows)[base] if base is not None else rows[0][1]
    for name, sec in rows:
        print(f"{name:>{width}}: {sec * scale:9.3f} {unit}  {sec / ref:6.2f} {ratio}", flush=True)
