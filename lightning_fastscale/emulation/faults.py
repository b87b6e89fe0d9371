"""Fault injection: one rank killed or hung in the middle of backward, and how the run ends.

More in ``docs/emulated_cluster.md`` ("Faults on the emulated cluster").
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["FAULTS", "STRATEGIES", "FaultOutcome", "format_outcomes", "run_fault_scenario"]

FAULTS = ("kill", "hang", "none")
STRATEGIES = ("ddp", "hier_ring", "hier_torus")
_ALGORITHM = {"hier_ring": "hier", "hier_torus": "torus2d"}


@dataclass(frozen=True)
class FaultOutcome:
    """What happened in one scenario.

    ``exited``: every rank but the faulty one ended on its own within the bound.
    ``seconds_to_exit``: from the fault to the last of them ending (from the start of training
    with ``fault="none"``). ``rank_errors``: rank -> the error it raised (type, message and
    causes). ``finished``: ranks that completed training. ``killed_leftovers``: ranks still
    running at the end (the hung rank, or a survivor that never noticed), then killed.
    ``exit_codes``: rank -> exit status of the ranks that ended (negative: killed by that signal);
    ``exit_seconds``: rank -> seconds from the fault to its end.
    """

    strategy: str
    fault: str
    fault_rank: int
    timeout_s: float
    exited: bool
    seconds_to_exit: float | None
    rank_errors: dict[int, str] = field(default_factory=dict)
    finished: tuple[int, ...] = ()
    killed_leftovers: tuple[int, ...] = ()
    exit_codes: dict[int, int] = field(default_factory=dict)
    exit_seconds: dict[int, float] = field(default_factory=dict)
    log_tail: str = ""

    @property
    def what_happened(self) -> str:
        """One line: how the run ended."""
        if not self.exited:
            return f"still running at the bound ({len(self.killed_leftovers)} processes killed)"
        if self.fault == "none":
            return "finished" if len(self.finished) else "failed without a fault"
        survivors = sorted(self.rank_errors)
        first = next(iter(self.rank_errors.values()), "no error recorded").splitlines()[0]
        return f"ranks {survivors} raised; e.g. {first[:160]}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a rendezvous on this machine)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_fault_scenario(
    strategy: str = "hier_ring",
    fault: Literal["kill", "hang", "none"] = "kill",
    *,
    timeout_s: float = 5.0,
    world_size: int = 4,
    ranks_per_node: int = 2,
    fault_rank: int = 1,
    fault_step: int = 2,
    bound_s: float | None = None,
    startup_s: float = 600.0,
    hung_grace_s: float = 15.0,
    workdir: str | os.PathLike | None = None,
) -> FaultOutcome:
    """Run one scenario and report it (see the module docstring).

    ``strategy``: ``"ddp"``, ``"hier_ring"`` or ``"hier_torus"`` (``ranks_per_node`` ranks per
    emulated node, all on this machine). ``timeout_s``: the strategy's ``timeout``.
    ``bound_s``: how long after the fault every process may take to end (default ``4 *
    timeout_s + 30``); ``startup_s``: how long the ranks may take to reach the fault;
    ``hung_grace_s``: how long a hung rank may take to end after all others have. Needs
    only CPU and loopback TCP.

    Examples:
        >>> outcome = run_fault_scenario("hier_ring", "hang", timeout_s=5)  # doctest: +SKIP
        >>> outcome.what_happened, outcome.seconds_to_exit  # doctest: +SKIP
        ("ranks [0, 2, 3] raised; e.g. CommHookError: hier all-reduce of DDP bucket 1 failed ...", 6.1)
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: choose one of {STRATEGIES}")
    if fault not in FAULTS:
        raise ValueError(f"fault={fault!r}: choose one of {FAULTS}")
    if not 0 <= fault_rank < world_size:
        raise ValueError(f"fault_rank={fault_rank} must be a rank of the world of {world_size}")
    bound_s = 4 * timeout_s + 30 if bound_s is None else bound_s
    with tempfile.TemporaryDirectory(prefix="fastscale-fault-", dir=workdir) as tmp:
        out = Path(tmp)
        cfg = dict(strategy=strategy, fault=fault, timeout_s=timeout_s, world_size=world_size,
                   ranks_per_node=ranks_per_node, fault_rank=fault_rank, fault_step=fault_step, out=str(out),
                   startup_s=startup_s, hung_grace_s=hung_grace_s)
        port = free_port()
        procs: list[subprocess.Popen] = []
        logs = []
        try:
            for rank in range(world_size):
                env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                           LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0")
                logs.append(open(out / f"rank{rank}.log", "w"))
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "lightning_fastscale.emulation.faults", "--worker", json.dumps(cfg)],
                    stdout=logs[-1], stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True,
                ))
            return _watch(procs, out, cfg, bound_s, startup_s)
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            for proc in procs:
                proc.wait(timeout=30)
            for log in logs:
                log.close()


def _mark(path: Path) -> None:
    """Write the time into ``path`` whole: the watcher polls for the file and must never read it half-written."""
    part = path.with_suffix(".part")
    part.write_text(repr(time.time()))
    os.replace(part, path)


def _watch(procs: list[subprocess.Popen], out: Path, cfg: dict, bound_s: float, startup_s: float) -> FaultOutcome:
    start = time.monotonic()
    marker = out / ("fault.time" if cfg["fault"] != "none" else "started.time")
    # Phase 1: wait for the fault (or the start of training), bounded; stop early if every rank ended.
    while not marker.exists() and time.monotonic() - start < startup_s:
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    fault_at = float(marker.read_text()) if marker.exists() else None
    # Phase 2: every rank ends on its own, within the bound.
    ended_at: dict[int, float] = {}
    survivors_ended: float | None = None
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and len(ended_at) < len(procs):
        for rank, proc in enumerate(procs):
            if rank not in ended_at and proc.poll() is not None:
                ended_at[rank] = time.time()
        if cfg["fault"] == "hang" and set(ended_at) == set(range(len(procs))) - {cfg["fault_rank"]}:
            # only the hung rank is left: it gets a grace period to end itself, then the launcher's kill
            survivors_ended = survivors_ended or time.monotonic()
            if time.monotonic() - survivors_ended > cfg["hung_grace_s"]:
                break
        time.sleep(0.05)
    leftovers = tuple(rank for rank, proc in enumerate(procs) if proc.poll() is None)
    survivors = [r for r in range(len(procs)) if r != cfg["fault_rank"] or cfg["fault"] == "none"]
    all_ended = all(r in ended_at for r in survivors)
    errors = {int(p.stem[4:]): p.read_text() for p in out.glob("rank*.error")}
    finished = tuple(sorted(int(p.stem[4:]) for p in out.glob("rank*.done")))
    tails = "".join(f"--- rank {r}\n{(out / f'rank{r}.log').read_text()[-1500:]}\n" for r in range(len(procs))
                    if (out / f"rank{r}.log").exists())
    last = max((ended_at[r] for r in survivors if r in ended_at), default=None)
    return FaultOutcome(
        strategy=cfg["strategy"], fault=cfg["fault"], fault_rank=cfg["fault_rank"], timeout_s=cfg["timeout_s"],
        exited=all_ended and fault_at is not None,
        seconds_to_exit=None if fault_at is None or last is None or not all_ended else max(0.0, last - fault_at),
        rank_errors=dict(sorted(errors.items())), finished=finished, killed_leftovers=leftovers,
        exit_codes={r: procs[r].returncode for r in sorted(ended_at)},
        exit_seconds={} if fault_at is None else {r: round(t - fault_at, 2) for r, t in sorted(ended_at.items())},
        log_tail=tails,
    )


# -- worker side: every rank of the training run ------------------------------------------------
def _make_strategy(cfg: dict) -> Any:
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    timeout = timedelta(seconds=cfg["timeout_s"])
    if cfg["strategy"] == "ddp":
        return DDPStrategy(timeout=timeout, bucket_cap_mb=0.05)
    from lightning_fastscale.strategies import HierarchicalAllReduceStrategy

    return HierarchicalAllReduceStrategy(
        algorithm=_ALGORITHM[cfg["strategy"]], ranks_per_node=cfg["ranks_per_node"], timeout=timeout,
        bucket_cap_mb=0.05,
    )


def _worker(cfg: dict) -> None:
    from datetime import timedelta

    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    out = Path(cfg["out"])

    class Faulty(pl.LightningModule):
        """Four linear layers (several DDP buckets); the fault fires in the first layer's gradient."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                                     nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4))
            self.net[0].weight.register_hook(self._maybe_fault)

        def _maybe_fault(self, grad: torch.Tensor) -> torch.Tensor:
            if self.global_rank == cfg["fault_rank"] and self.trainer.global_step == cfg["fault_step"]:
                _mark(out / "fault.time")
                if cfg["fault"] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif cfg["fault"] == "hang":
                    time.sleep(3600)
            return grad

        def on_train_start(self) -> None:
            if self.global_rank == 0:
                _mark(out / "started.time")

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    # Start together, as torchrun's workers do: the short time-out also bounds the rendezvous.
    rank, world = int(os.environ["RANK"]), cfg["world_size"]
    (out / f"rank{rank}.ready").write_text("ready")
    deadline = time.monotonic() + cfg["startup_s"]
    while len(list(out.glob("rank*.ready"))) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world,
                                         timeout=timedelta(seconds=cfg["timeout_s"]))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=g)
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
    trainer = pl.Trainer(
        strategy=_make_strategy(cfg), accelerator="cpu", devices=cfg["world_size"], max_steps=cfg["fault_step"] + 3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    try:
        trainer.fit(Faulty(), data)
    except BaseException as error:
        chain, seen = [], error
        while seen is not None and len(chain) < 4:
            chain.append(f"{type(seen).__name__}: {seen}")
            seen = seen.__cause__ or seen.__context__
        (out / f"rank{rank}.error").write_text("\n  caused by ".join(chain))
        raise
    (out / f"rank{rank}.done").write_text("ok")


def format_outcomes(outcomes: list[FaultOutcome]) -> str:
    """Markdown table: each scenario, what happened, seconds to exit (and per rank)."""
    lines = ["| strategy | fault | time-out s | every other rank ended | s to exit (per rank) | what happened |",
             "|---|---|---|---|---|---|"]
    for o in outcomes:
        per_rank = ", ".join(f"{r}: {t:.1f}" for r, t in o.exit_seconds.items())
        seconds = "-" if o.seconds_to_exit is None else f"{o.seconds_to_exit:.1f} ({per_rank})"
        lines.append(f"| {o.strategy} | {o.fault} (rank {o.fault_rank}) | {o.timeout_s:g} | {'yes' if o.exited else 'no'} "
                     f"| {seconds} | {o.what_happened.replace('|', '/')} |")
    return "\n".join(lines)


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help="JSON config (internal: one rank of run_fault_scenario)")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--faults", nargs="+", default=["kill", "hang"], choices=FAULTS)
    parser.add_argument("--timeout", type=float, default=5.0, help="the strategy's time-out in seconds")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return
    outcomes = [run_fault_scenario(s, f, timeout_s=args.timeout) for s in args.strategies for f in args.faults]
    print(format_outcomes(outcomes))


if __name__ == "__main__":
    _main()
