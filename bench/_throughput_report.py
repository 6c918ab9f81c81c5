"""What ``bench.throughput`` prints: the results table, the scaling table and the ratio lines."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

OURS = "airflow-broker"
#: The peer the targets are held against: pgmq at its fastest.
PEER = "pgmq-pop"
#: workload -> goal of ``target {workload}_vs_pgmq_pop``.
PEER_GOALS: dict[str, float] = {"single": 1.0, "batched": 1.5}
#: Goal of ``target deep_queue_vs_empty``.
DEEP_GOAL = 0.8
#: airflow-broker SENDing to a service of another broker database (bench/_broker_system.py).
REMOTE = "airflow-broker-remote"
#: Goal of ``target remote_send_vs_local_{workload}``.
REMOTE_GOAL = 0.8
#: The reader counts a target is the lowest ratio over (when measured).
TARGET_READERS = (1, 2)
#: How a peer is named in the ratio lines.
LABELS: dict[str, str] = {
    "pgmq-pop": "pgmq_pop",
    "pgmq": "pgmq_read_archive",
    "pgqueuer": "pgqueuer",
}


@dataclass(frozen=True, slots=True)
class Round:
    """One measured round."""

    send_seconds: float
    #: from the first reader's start to the last committed consume
    receive_seconds: float
    transactions: int
    #: messages the producer enqueued (the round's count)
    sent: int
    #: messages the readers took; more than ``sent`` only from a deep queue, where the readers'
    #: last transactions may take up to (readers - 1) x batch messages beyond the round's count
    consumed: int

    @property
    def receive_for_sent(self) -> float:
        """The receive time scaled to ``sent`` messages (== ``receive_seconds`` when equal)."""
        return self.receive_seconds * self.sent / self.consumed

    @property
    def seconds(self) -> float:
        """Send time + receive time of the round's messages."""
        return self.send_seconds + self.receive_for_sent


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table: the median round of one configuration."""

    system: str
    workload: str
    readers: int
    #: messages waiting on the queue when the first round started
    backlog: int
    messages: int
    round: Round
    repeats: int

    @property
    def rate(self) -> float:
        """Messages per second through the queue (enqueue + consume)."""
        return self.messages / self.round.seconds

    @property
    def receive_rate(self) -> float:
        """Messages per second of the consuming side alone."""
        return self.round.consumed / self.round.receive_seconds


def _align(lines: list[tuple[str, ...]], left: int) -> list[str]:
    """Columns padded to their widest cell; the first ``left`` left-aligned, a rule under row 0."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for n, line in enumerate(lines):
        cells = [
            cell.ljust(w) if i < left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def format_table(rows: Sequence[Row]) -> str:
    """The results as an aligned text table."""
    lines: list[tuple[str, ...]] = [
        (
            "system",
            "workload",
            "readers",
            "backlog",
            "messages",
            "seconds",
            "msgs/s",
            "send s",
            "receive s",
            "consume tx",
        )
    ]
    for r in rows:
        lines.append(
            (
                r.system,
                r.workload,
                str(r.readers),
                f"{r.backlog:,}",
                str(r.messages),
                f"{r.round.seconds:.3f}",
                f"{r.rate:,.0f}",
                f"{r.round.send_seconds:.3f}",
                f"{r.round.receive_for_sent:.3f}",
                str(r.round.transactions),
            )
        )
    return "\n".join(_align(lines, 2))


def format_scaling(rows: Sequence[Row]) -> str:
    """msgs/s per (system, workload, backlog) and reader count, and the most over the fewest."""
    readers = sorted({r.readers for r in rows})
    rate = {(r.system, r.workload, r.backlog, r.readers): r.rate for r in rows}
    keys = list(dict.fromkeys((r.workload, r.system, r.backlog) for r in rows))
    keys.sort(key=lambda k: (k[0] != "single", k[0], k[2]))
    head = ("workload", "system", "backlog", *(f"{n} reader{'s' * (n > 1)}" for n in readers))
    last = f"{readers[-1]} vs {readers[0]}" if len(readers) > 1 else ""
    lines: list[tuple[str, ...]] = [(*head, last) if last else head]
    for workload, system, backlog in keys:
        got = [rate.get((system, workload, backlog, n)) for n in readers]
        cells = [f"{v:,.0f}" if v is not None else "-" for v in got]
        if last:
            first, most = got[0], got[-1]
            cells.append(f"{most / first:.2f}x" if first and most else "-")
        lines.append((workload, system, f"{backlog:,}", *cells))
    return "scaling (msgs/s by reader processes)\n" + "\n".join(_align(lines, 2))


def _lowest(ratios: dict[int, float]) -> float:
    """The lowest ratio over :data:`TARGET_READERS`, or over all measured when neither was."""
    chosen = [v for k, v in ratios.items() if k in TARGET_READERS] or list(ratios.values())
    return min(chosen)


def _detail(ratios: Iterable[tuple[str, float]]) -> str:
    return ", ".join(f"{k}: {v:.2f}" for k, v in ratios)


def ratio_lines(rows: Sequence[Row], peers: Sequence[str]) -> tuple[list[str], list[str]]:
    """``target`` lines (held against pgmq-pop, and deep against empty) and ``info`` lines."""
    rate = {(r.system, r.workload, r.readers, r.backlog): r.rate for r in rows}
    targets: list[str] = []
    infos: list[str] = []
    workloads = list(dict.fromkeys(r.workload for r in rows))
    for peer in (p for p in peers if not p.startswith(OURS)):
        for workload in workloads:
            ratios = {
                n: rate[(OURS, workload, n, 0)] / rate[(peer, workload, n, 0)]
                for (system, w, n, backlog) in rate
                if system == OURS
                and w == workload
                and not backlog
                and (peer, workload, n, 0) in rate
            }
            if not ratios:
                continue
            name = f"{workload}_vs_{LABELS.get(peer, peer)}"
            detail = _detail((f"readers {k}", v) for k, v in sorted(ratios.items()))
            goal = PEER_GOALS.get(workload) if peer == PEER else None
            if goal is not None:
                targets.append(f"target {name}: {_lowest(ratios):.2f} (goal >= {goal})")
                infos.append(f"info {name}: {detail}")
            else:
                infos.append(
                    f"info {name}: {_lowest(ratios):.2f} (lowest of 1, 2 readers; {detail})"
                )
    targets += _remote_lines(rows)
    deep = _deep_ratios(rows, lambda r: r.rate)
    receive = _deep_ratios(rows, lambda r: r.receive_rate)
    for system, ratios in deep.items():
        label = "" if system == OURS else f"_{LABELS.get(system, system)}"
        detail = _detail((f"{w} readers {n}", v) for (w, n), v in sorted(ratios.items()))
        if system == OURS:
            lowest = _lowest_deep(ratios)
            targets.append(f"target deep_queue_vs_empty: {lowest:.2f} (goal >= {DEEP_GOAL})")
            infos.append(f"info deep_queue_vs_empty: {detail}")
        else:
            infos.append(
                f"info deep_queue_vs_empty{label}: {_lowest_deep(ratios):.2f} "
                f"(lowest of 1, 2 readers; {detail})"
            )
        only = receive[system]
        detail = _detail((f"{w} readers {n}", v) for (w, n), v in sorted(only.items()))
        infos.append(
            f"info deep_queue_receive_vs_empty{label}: {_lowest_deep(only):.2f} "
            f"(receive time alone, lowest of 1, 2 readers; {detail})"
        )
    vs = {
        (r.workload, r.readers): r.rate / rate[(PEER, r.workload, r.readers, r.backlog)]
        for r in rows
        if r.system == OURS and r.backlog and (PEER, r.workload, r.readers, r.backlog) in rate
    }
    if vs:
        detail = _detail((f"{w} readers {n}", v) for (w, n), v in sorted(vs.items()))
        infos.append(
            f"info deep_queue_vs_pgmq_pop: {_lowest_deep(vs):.2f} "
            f"(both deep; lowest of 1, 2 readers; {detail})"
        )
    return targets, infos


def _deep_ratios(
    rows: Sequence[Row], measure: Callable[[Row], float]
) -> dict[str, dict[tuple[str, int], float]]:
    """system -> (workload, readers) -> ``measure`` with the backlog over ``measure`` empty."""
    empty = {(r.system, r.workload, r.readers): r for r in rows if not r.backlog}
    out: dict[str, dict[tuple[str, int], float]] = {}
    for r in rows:
        base = empty.get((r.system, r.workload, r.readers))
        if r.backlog and base is not None:
            out.setdefault(r.system, {})[(r.workload, r.readers)] = measure(r) / measure(base)
    return out


def _lowest_deep(ratios: dict[tuple[str, int], float]) -> float:
    """The lowest over every workload, at :data:`TARGET_READERS` when any of them was measured."""
    chosen = [v for (_, n), v in ratios.items() if n in TARGET_READERS] or list(ratios.values())
    return min(chosen)


def _remote_lines(rows: Sequence[Row]) -> list[str]:
    """``target remote_send_vs_local_{workload}``: SENDs a second to a service of another
    broker over SENDs a second to a local service (the send time alone: delivery is the far
    side's), same workload and readers, the lowest of 1 and 2 readers."""
    send = {
        (r.system, r.workload, r.readers): r.messages / r.round.send_seconds
        for r in rows
        if not r.backlog
    }
    lines = []
    for workload in dict.fromkeys(r.workload for r in rows):
        ratios = {
            n: send[(REMOTE, w, n)] / send[(OURS, w, n)]
            for (system, w, n) in send
            if system == REMOTE and w == workload and (OURS, w, n) in send
        }
        if ratios:
            detail = _detail((f"readers {k}", v) for k, v in sorted(ratios.items()))
            lines.append(
                f"target remote_send_vs_local_{workload}: {_lowest(ratios):.2f} "
                f"(goal >= {REMOTE_GOAL}; {detail})"
            )
    return lines
