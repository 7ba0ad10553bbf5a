"""Commit bookkeeping and the final report: metrics records, progress, periodic and
final saves, and the dashboard status line.

A commit is one step in lockstep and one round of local steps otherwise; progress,
metrics and saves count optimizer steps either way.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Awaitable
from typing import Any, Protocol

from daisyweb.checkpoints.checkpoint import CheckpointError, TokenizerInfo, save_checkpoint
from daisyweb.peer.exchange import RecordingEncoder, Trainer, mode
from daisyweb.peer.hardware import hardware_info
from daisyweb.peer.options import PeerOptions, log
from daisyweb.protocol import sync
from daisyweb.training.metrics import (
    MetricsWriter,
    Progress,
    kernel_backend,
    kernel_line,
    kernel_report,
)
from daisyweb.training.state import TrainState
from signaling.protocol import MAX_ETA_S, MAX_LINKS, MAX_RTT_MS

__all__ = ["Report", "StatusSink", "peak_rss_bytes", "round_note"]


def round_note(c: sync.Commit, remaining: int, shortest: int) -> str:
    """A committed round on the progress line: its number of the run's (as many more
    as the rest takes at this length), and when the leader lengthened it past the
    shortest, why: ``round 5/9  32 steps (exchange 27)``."""
    rounds = c.step + 1 + (-(-remaining // c.length) if c.length else 0)
    note = f"round {c.step + 1}/{rounds}"
    if c.length > shortest:
        note += f"  {c.length} steps (exchange {c.need})"
    return note


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux ``ru_maxrss`` is in KiB); 0 where the
    platform has no ``resource`` module (Windows)."""
    try:
        import resource
    except ImportError:
        return 0
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kib) * (1 if sys.platform == "darwin" else 1024)


class StatusSink(Protocol):
    """Where the dashboard status goes (the mesh)."""

    def report_status(self, **fields: object) -> Awaitable[None]: ...


class Report:
    """What this peer writes about its run, from the first commit to the end record."""

    def __init__(self, opts: PeerOptions, tokinfo: TokenizerInfo) -> None:
        self.opts = opts
        self.tokinfo = tokinfo
        self.metrics = MetricsWriter(opts.metrics)  # OSError: the caller names --metrics
        self.progress: Progress | None = None
        self.last_loss = 0.0
        self.last_peers = 1
        self.last_extra: dict[str, float | str] = {}  # tokens_per_s and probe of the last step
        self.last_saved = -1
        self.last_eval = -1
        # The last held-out loss and its step, sent with every status (reports coalesce).
        self.last_heldout: tuple[float, int] | None = None
        # The dashboard's pool view shows each member's hardware: sent with every report.
        self.hardware = hardware_info()
        self.last_pool: dict[str, Any] = {}
        self.step_t0: dict[int, float] = {}
        self.compute_s: dict[int, float] = {}
        self.ready_at: dict[int, float] = {}
        self.head_steps: dict[int, int] = {}
        # Head starts (--overlap) by round: started, and when done: (seconds, finished at).
        self.heads: dict[int, tuple[float, float] | None] = {}

    def begin(self, state: TrainState) -> None:
        """The run starts (or joins) at ``state.step``."""
        self.progress = Progress(state.run.steps,
                                 stream=sys.stderr if self.opts.progress else None)
        self.progress.start(state.step)
        self.last_saved = state.step  # --save-every counts from where this run starts
        self.last_eval = state.step

    def computing(self, step: int) -> None:
        """The machine asked for the contribution of ``step``: its wall time starts."""
        self.step_t0.setdefault(step, time.monotonic())

    def head_started(self, index: int) -> None:
        """Round ``index``'s head start began (while the previous exchange is in flight)."""
        self.heads[index] = None
        for old in [k for k in self.heads if k < index - 2]:
            del self.heads[old]

    def head_finished(self, index: int, secs: float, now: float) -> None:
        if index in self.heads:
            self.heads[index] = (secs, now)

    def head_secs(self, index: int | None) -> float:
        """Seconds of round ``index``'s head start (0 for none)."""
        done = self.heads.get(index) if index is not None else None
        return done[0] if done else 0.0

    def _idle_from(self, step: int, ready: float, now: float) -> float:
        """When this peer ran out of work while round ``step`` was exchanged: when its
        contribution was ready or, with a head start of the next round, when that ended."""
        if step + 1 not in self.heads:
            return ready
        done = self.heads[step + 1]
        return now if done is None else max(ready, done[1])

    def contribution_ready(self, step: int, compute_s: float, now: float,
                       head_steps: int = 0) -> None:
        """Our contribution of ``step`` is computed; the exchange starts."""
        self.compute_s[step] = compute_s
        self.head_steps[step] = head_steps
        self.ready_at[step] = now

    async def commit(self, c: sync.Commit, trainer: Trainer, state: TrainState,
                     encoder: RecordingEncoder, status: StatusSink) -> None:
        """One committed step or round: progress, a metrics record, maybe a save."""
        assert self.progress is not None
        now = time.monotonic()
        run = state.run
        done = trainer.inner_steps
        inner = c.length
        tokens = run.batch * run.task_impl.ROW_TOKENS * len(c.roster) * inner
        t0 = self.step_t0.pop(c.step, now)
        ready = self.ready_at.pop(c.step, now)
        compute_s = self.compute_s.pop(c.step, 0.0)
        head_steps = self.head_steps.pop(c.step, 0)
        # comm_s: the exchange's time not hidden behind the next round's head start
        # (the communication share users see); exchange_s: all of it.
        exchange_s = max(0.0, now - ready)
        comm_s = max(0.0, now - self._idle_from(c.step, ready, now))
        wall_s = max(0.0, now - t0)
        comm_share = comm_s / wall_s if wall_s > 0 else 0.0
        loss = c.loss if c.loss is not None else math.nan
        note = f"{mode(run)}{' owners' if c.owners else ''}  comm {comm_share:.0%}"
        if run.sync_every > 1:
            note = f"{round_note(c, run.steps - done, run.sync_every)}  " + note
        if head_steps:  # this round's first steps, taken while the last one's bytes crossed
            note += f"  ahead {head_steps}/{inner}"
        if c.rollback:
            note += "  (committed again: the roster was amended)"
        heldout = self._maybe_evaluate(state, done)
        if heldout is not None:
            note += f"  held-out {heldout[0]:.3f}"
        tokens_per_s = self.progress.update(done, loss, tokens, note=note)
        share = _own_share(c, getattr(status, "self_id", None))
        pool = self._pool_fields(c, state, share * tokens, compute_s, status, share)
        record = {
            "time": time.time(),  # wall clock of the commit: gaps across peers and faults
            "step": done, "loss": loss, "weight_hash": c.weight_hash,
            "probe_hash": c.probe_hash, "roster": list(c.roster),
            "tokens_per_s": tokens_per_s, "comm_s": comm_s, "exchange_s": exchange_s,
            "compute_s": compute_s, "wall_s": wall_s, "comm_share": comm_share,
            "mode": mode(run), "sync_every": run.sync_every, "codec": run.codec,
            "round": c.step + 1, "bytes_sent": encoder.bytes_sent, "head_steps": head_steps,
            "round_steps": inner, "exchange_steps": c.need,
            "transport": self.opts.transport,
            "share": pool["share"], "peer_tokens_per_s": pool["peer_tokens_per_s"],
        }
        if c.shares:  # capacity-weighted: sequences per roster member, in roster order
            record["shares"] = list(c.shares)
        if c.owners:  # the owner exchange: who reduced each part of the mean
            record["owners"] = list(c.owners)
        traffic = getattr(status, "traffic", None)
        if traffic is not None:  # frames on every link so far (data and heartbeats)
            record["wire_sent"], record["wire_received"] = traffic.sent, traffic.received
        if heldout is not None:
            record["heldout_loss"], record["eval_s"] = heldout
            if 0.0 <= heldout[0] < math.inf:
                self.last_heldout = (heldout[0], done)
        if c.rollback:
            record["rollback"] = True
        if c.clipped:  # members whose contribution was held to the bound (influence)
            record["clipped"] = list(c.clipped)
        self.metrics.write(record)
        every = self.opts.save_every
        if self.opts.save and every and done // every > self.last_saved // every:
            # The arrays are shared, not copied (16 MB): written out right here, on the
            # event loop, before anything can replace or step them.
            try:
                save_checkpoint(self.opts.save, state.checkpoint(self.tokinfo, copy=False))
                self.last_saved = done
            except CheckpointError as exc:
                # The write is atomic (the old file stays) and the replica is fine, so
                # training goes on; the next save (or the final one) tries again.
                log(f"could not save the checkpoint of step {done} "
                    f"(training goes on): {exc}")
        self.last_loss = float(loss) if math.isfinite(loss) else 0.0
        self.last_peers = len(c.roster)
        # Kept for the final report, so the dashboard still shows them after the run.
        self.last_extra = {"tokens_per_s": float(tokens_per_s), "probe": c.probe_hash[:16]}
        with contextlib.suppress(Exception):
            await status.report_status(
                step=done, loss=self.last_loss,
                hash=c.weight_hash[:16], peers=len(c.roster),
                tokens_per_s=float(tokens_per_s), probe=c.probe_hash[:16], state="training",
                mode=mode(run), round=c.step + 1, **self._transport(), **pool,
                **({"round_steps": inner, "exchange_steps": c.need} if run.rounds else {}),
                comm_share=min(max(comm_share, 0.0), 1.0),  # the server refuses outside 0..1
                # Every report, not just the evaluated one: the client coalesces reports
                # (the latest wins), which would otherwise drop it in a fast run.
                **({"heldout_loss": self.last_heldout[0],
                    "heldout_step": self.last_heldout[1]}
                   if self.last_heldout is not None else {}))

    def _transport(self) -> dict[str, str]:
        """The WebRTC implementation for the dashboard, once run_peer resolved it (an
        in-process test mesh leaves "auto", which the server would refuse)."""
        t = self.opts.transport
        return {"transport": t} if t in ("aiortc", "libwebrtc") else {}

    def _pool_fields(self, c: sync.Commit, state: TrainState, own_tokens: float,
                     compute_s: float, status: StatusSink, share: float) -> dict[str, Any]:
        """The pool view's fields of one commit: machine and kernel backend, this peer's
        share of the batch and its own speed, the ETA, and its links' round-trip times."""
        assert self.progress is not None
        pool: dict[str, Any] = {
            **self.hardware, "backend": kernel_backend(), "share": share,
            "peer_tokens_per_s": own_tokens / compute_s if compute_s > 0 else 0.0,
            "total_steps": state.run.steps,
        }
        eta = self.progress.eta_s(self.progress.last_step)
        if math.isfinite(eta):
            pool["eta_s"] = min(max(eta, 0.0), MAX_ETA_S)
        self.last_pool = {k: v for k, v in pool.items() if k != "eta_s"}
        rtts = getattr(status, "link_rtts", None)  # a test sink may have no links
        if rtts is not None:
            pool["links"] = {p: (None if r is None else round(min(r * 1000.0, MAX_RTT_MS), 3))
                             for p, r in list(rtts().items())[:MAX_LINKS]}
        return pool

    def _maybe_evaluate(self, state: TrainState, done: int) -> tuple[float, float] | None:
        """Held-out loss and its seconds when ``--eval-every`` says so (else None).

        Evaluated on the shared weights at the boundary (in rounds: the anchor), on the
        fixed batches ``daisyweb-eval`` uses; about a tenth of a second at the default model.
        The run's last step is always evaluated: the curve ends where the run does.
        """
        every = self.opts.eval_every
        last = done >= state.run.steps and done > self.last_eval
        if not every or (done // every <= self.last_eval // every and not last):
            return None
        t0 = time.perf_counter()
        loss = state.run.task_impl.heldout(state.params)
        self.last_eval = done
        return loss, time.perf_counter() - t0

    def save_now(self, state: TrainState) -> None:
        """Save the replica (a committed boundary) to --save, if asked for, saying so."""
        if not self.opts.save:
            return
        try:
            save_checkpoint(self.opts.save, state.checkpoint(self.tokinfo, copy=False))
        except CheckpointError as exc:
            log(f"could not save the checkpoint of step {state.step}: {exc}")
            return
        log(f"checkpoint of step {state.step} saved to {self.opts.save}")

    async def finish(self, result: tuple[int, str], state: TrainState, shared_hash: str,
                     status: StatusSink) -> int:
        """The end record, the final save and the last status; returns the exit code."""
        code, reason = result
        # The replica is always a committed boundary (a refused step touches nothing).
        saved = None
        save_error = None
        if self.opts.save and state is not None:
            try:
                save_checkpoint(self.opts.save, state.checkpoint(self.tokinfo, copy=False))
                saved = self.opts.save
            except CheckpointError as exc:
                save_error = str(exc)
        end: dict[str, object] = {"end": reason, "step": state.step,
                               # What the group shares (in rounds: not the local moments).
                               "weight_hash": shared_hash}
        if save_error is not None:
            end["save_error"] = save_error
        end["peak_rss_bytes"] = peak_rss_bytes()  # VmHWM: what this peer needed at most
        stalls = getattr(status, "stalls", None)  # the event loop's longest stall, measured
        if stalls is not None:
            end["loop_stall_max_s"] = round(stalls.longest, 3)
        kernels: dict[str, Any] | None = None  # as kernel_report() types it
        with contextlib.suppress(Exception):  # the report must never hide the run's end
            kernels = end["kernels"] = kernel_report()
        self.metrics.write(end)
        with contextlib.suppress(Exception):
            await status.report_status(
                step=state.step, loss=self.last_loss, hash=end["weight_hash"][:16],
                peers=self.last_peers, state="done" if code == 0 else "halted",
                mode=mode(state.run), **self._transport(), **self.last_pool,
                **self.last_extra)
        if code == 0:
            log(f"done at step {state.step}, weight hash {end['weight_hash'][:16]}"
                + (f", saved {saved}" if saved else ""))
        elif saved:
            log(f"checkpoint of step {state.step} saved to {saved}")
        if kernels is not None:
            log(kernel_line(kernels))
        if save_error is not None:
            # A run whose final checkpoint is lost did not end well, even if it trained.
            log(f"could not save the final checkpoint of step {state.step}: {save_error}")
            code = code or 1
        return code

    def close(self) -> None:
        self.metrics.close()


def _own_share(c: sync.Commit, self_id: str | None) -> float:
    """This peer's fraction of the commit's sequences (equal shares without weights)."""
    if not c.roster:
        return 0.0
    if c.shares and self_id in c.roster:
        return c.shares[c.roster.index(self_id)] / sum(c.shares)
    return 1.0 / len(c.roster)
