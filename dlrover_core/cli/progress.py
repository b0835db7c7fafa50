"""The console view of a running job (rich)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

from dlrover_core.cli.output import console_for, format_restarts

#: Below this console width (columns) the bar itself is left out, so that the step
#: count and the metrics keep their room.
NARROW_WIDTH = 100

#: Seconds between the plain progress lines printed when stderr is not a terminal.
PLAIN_INTERVAL_S = 10.0


class JobProgress:
    """A progress bar: step / total, loss, samples/s, restarts, elapsed time.

    samples/s is rank 0's ``samples_per_s``: with :class:`~dlrover_core.tuning.StepTimer`
    the global samples of its last ``rate_window`` steps over their wall time, data
    waits and the loop's own time between steps included (never a per-step rate).

    The step count (``400/400``) is never cut: on a console narrower than
    :data:`NARROW_WIDTH` the bar is left out and the metrics fold onto more lines.
    When the console is not a terminal (a file, a pipe, CI) there is no bar: a plain
    line (``nanogpt: running step 41/400 | loss 1.900 | 530 samples/s | 35 s``) is
    printed when the state changes, every ``interval_s`` seconds (default
    :data:`PLAIN_INTERVAL_S`) while it runs, and once at the end.
    """

    def __init__(self, enabled: bool = True, console: Console | None = None,
                 interval_s: float = PLAIN_INTERVAL_S) -> None:
        self.enabled = enabled
        self.console = console or console_for(stderr=True)
        self.plain = not self.console.is_terminal
        self.interval_s = interval_s
        self._t0 = time.monotonic()
        self._last_line: tuple[float, str] | None = None  # (when, state) of the last
        self._last_text: str | None = None  # the last line printed, without its time
        self._pending: tuple[str, str] | None = None  # (line, its text) not printed yet
        columns: list[Any] = [TextColumn("[bold]{task.description}",
                                         table_column=Column(no_wrap=True))]
        if self.console.width >= NARROW_WIDTH:
            columns.append(BarColumn())
        columns += [MofNCompleteColumn(table_column=Column(no_wrap=True)),
                    TextColumn("{task.fields[info]}", table_column=Column(overflow="fold")),
                    TimeElapsedColumn(table_column=Column(no_wrap=True))]
        self._progress = Progress(*columns, console=self.console,
                                  disable=not enabled or self.plain, transient=False)
        self._task: Any = None

    def __enter__(self) -> JobProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.__exit__(*exc)
        if self._pending is not None and self._pending[1] != self._last_text:
            self._print(*self._pending)  # the end, unless the last line printed said it

    def _print(self, line: str, text: str | None = None) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        self._last_text = text
        self._pending = None

    def _plain(self, st: dict, parts: list[str]) -> None:
        """The plain line of ``st`` (``parts``: its state, then its metrics): printed at
        once when the state changed or ``interval_s`` passed since the last one, else
        kept for the end."""
        total = st.get("total_steps")
        step = f"step {max(st.get('step', -1) + 1, 0)}" + (f"/{total}" if total else "")
        now = time.monotonic()
        text = " | ".join([f"{st['name']}: {parts[0]} {step}", *parts[1:]])
        line = f"{text} | {now - self._t0:.0f} s"
        if (self._last_line is None or self._last_line[1] != parts[0]
                or now - self._last_line[0] >= self.interval_s):
            self._last_line = (now, parts[0])
            self._print(line, text)
        else:
            self._pending = (line, text)

    def update(self, st: dict) -> None:
        if self._task is None:
            self._task = self._progress.add_task(st["name"], total=st.get("total_steps"),
                                                 info="")
        m = st.get("metrics", {})
        # the summary's status once there is one (``already_complete``, not ``succeeded``)
        parts = [(st.get("summary") or {}).get("status") or st["state"]]
        for key, fmt in (("loss", "loss {:.3f}"), ("val_loss", "val {:.3f}"),
                         ("mean_return", "return {:.1f}"), ("samples_per_s", "{:.0f} samples/s"),
                         ("tuning_version", "tuning v{:.0f}")):
            if key in m:
                parts.append(fmt.format(m[key]))
        if (st.get("restarts") or {}).get("total", 0):
            parts.append(f"restarts {format_restarts(st['restarts'])}")
        self._progress.update(self._task, completed=max(st.get("step", -1) + 1, 0),
                              info=" | ".join(parts))
        if self.plain and self.enabled:
            self._plain(st, parts)


def print_summary(summary: dict, console: Console | None = None) -> None:
    """The end-of-job summary table; then, when the summary has
    ``checkpoint_not_persisted`` (saves a plugin could not write to disk by the job's
    end), one line naming each (role, rank, step, buffer), the checkpoint folder they
    missed and how to list (``dlrover flash ls``) or drop them; then the error."""
    from rich.table import Table

    console = console or console_for()
    t = Table(title=f"job {summary.get('name')}: {summary.get('status')}", show_header=False)
    t.add_column("key", style="bold", no_wrap=True)
    t.add_column("value", overflow="fold")
    if summary.get("run"):
        t.add_row("run", str(summary["run"]))
    for role, r in sorted((summary.get("resumed_from") or {}).items()):
        t.add_row("resumed", f"{role} from step {r['step']} ({r.get('source')}, "
                             f"checkpoint {r.get('path')})")
    t.add_row("steps", str(summary.get("steps")))
    t.add_row("wall time", f"{summary.get('wall_s', 0):.1f} s")
    t.add_row("restarts", format_restarts(summary.get("restarts")))
    if summary.get("goodput") is not None:
        t.add_row("goodput", f"{summary['goodput']:.3f}")
    tuning = summary.get("tuning")
    if tuning and tuning.get("config"):
        c = tuning["config"]
        accum = c["optimizer"]["grad_accum_steps"]
        t.add_row("tuning", f"version {tuning['version']} ({tuning['accepted']} kept, "
                            f"{tuning['reverted']} reverted): micro-batch "
                            f"{c['dataloader']['batch_size']} x {accum}"
                            f" accumulation, {c['dataloader']['num_workers']} loader workers, "
                            f"lr {c['optimizer']['learning_rate']:.3g}")
    for k, v in sorted((summary.get("metrics") or {}).items()):
        t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    console.print(t)
    lost = summary.get("checkpoint_not_persisted") or []
    if lost:
        dirs = sorted({k.get("shm_dir") or "/dev/shm" for k in lost})
        ls = "; ".join("dlrover flash ls" + ("" if d == "/dev/shm" else f" --shm-dir {d}")
                       for d in dirs)
        console.print(
            "[bold yellow]checkpoint not persisted:[/] " + escape(", ".join(
                f"{k.get('role')} rank {k.get('rank')} step {k.get('step')} (buffer "
                f"{k.get('name')})" for k in lost)
                + f" did not reach {', '.join(sorted({str(k.get('dir')) for k in lost}))}; "
                f"their shared-memory buffers are kept (`{ls}` lists them): the next run of "
                f"the job loads them, `dlrover flash clean --job {summary.get('name')} "
                "--force` drops them"), markup=True, highlight=False)
    if summary.get("error"):
        # the error is the job's own text (a gloo message holds "[/path/pair.cc:553]"):
        # escaped, not read as markup
        console.print("[bold red]error:[/] " + escape(summary["error"]), markup=True,
                      highlight=False)
