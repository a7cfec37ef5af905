r"""Honest learners' service while attackers hit the same syncer: the starvation defences, measured.

  python -m experiments.benchmarks.hostile [--phase_seconds=45]

A real syncer process (experiments.launch_local's LocalCluster, the demo model, 5 learner
ids) on loopback. Learners 0-3 are honest: each (a process of its own) computes for
`--round_seconds` (a sleep: the syncer's side is what is measured), then pushes its round
and pulls Θ, waiting for both (`blocked`). Learner 4 is compromised: the attackers (another
process) hold its credential, and none other. Undisturbed windows alternate with windows
under bounded attacker loops (experiments/benchmarks/attacks.py), `--windows` of each, so
that a change in the shared machine's load falls on both phases alike: reconnect floods of
the data port (connect-and-close and idle holders), slow senders trickling ticketed payloads,
Push streams that stall after their header, and poison headers (out of bounds,
impersonating learner 0, shapes overflowing int64, forged tokens). An attack window ends
once its loops have stopped, and the next undisturbed window starts only then. Then the
honest learners spend the rest of the budget, so that the syncer ends the run and its
summary counts every refusal.

What it measures, and what it leaves out: everything shares one machine's cores, where a real
attacker would be other machines. So the attackers run at `--attacker_nice` (10) above the
syncer, and the reconnect floods are paced to `--flood_rate` connects a second in all (2,400:
about twice what the syncer of a thread per connection could accept here), so that the attack's
volume is the same whatever the syncer's speed. At these settings a syncer without the
accept-side defence (a thread per connection) failed the target once in two runs on a loaded
machine and cost up to twice the CPU per honest exchange; docs/security.md has the runs.

JSON keys: `honest_push_p99_seconds` (an honest push + pull under attack, p99),
`blocked_ratio` (honest blocked fraction under attack / undisturbed; target <= 2),
`honest_refused` (honest exchanges that failed; target 0), `refused` (the syncer's refusal
counters by kind), `syncer_rss_growth_mb` (the syncer's resident memory at the last attack
window's end minus at the first one's start; target <= 64). The JSON line before it has the
attack volume and `syncer_cpu_ratio` (the syncer's CPU seconds per honest exchange under attack / undisturbed:
its own cost of the attack, whatever the machine's load).
"""

import collections
import multiprocessing
import os
import queue as queue_lib
import tempfile
import time

import numpy as np

from decoupled_diloco import metrics as metrics_lib
from experiments.benchmarks import attacks, common
from experiments.launch_local import LocalCluster

HONEST, ATTACKER = (0, 1, 2, 3), 4
SECRET = "hostile-benchmark-secret-0123456789"
INNER_STEPS, BATCH, SEQ_LEN = 25, 4, 64
OVERRIDES = ("--config.mode=decoupled", "--config.learners.devices=(1,1,1,1,1)",
             f"--config.learners.batch_size=({BATCH},{BATCH},{BATCH},{BATCH},{BATCH})",
             f"--config.model.seq_len={SEQ_LEN}", f"--config.inner_steps={INNER_STEPS}", "--config.syncer.quorum=1",
             "--config.outer.optimizer=delayed_nesterov", "--config.outer.buffer_size=4", "--config.eval_every=100000",
             "--config.service.learner_checkpoint_every=0", "--config.service.linger_seconds=3",
             "--config.service.lease_seconds=600", f"--config.syncer.min_learners_to_start={len(HONEST)}")


def _honest(address: str, learner: int, go, finish, round_seconds: float, out) -> None:
  """One honest learner: rounds of (compute, push + pull) from `go` until `finish`, then the budget's rest fast."""
  from decoupled_diloco.service import client as client_lib  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.service import security  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  client = client_lib.SyncerClient(address, security.learner_credential(SECRET, learner), learner, chunk_bytes=1 << 20,
                                   timeout_seconds=60, retry_seconds=120, data_channel=True)
  status, theta = client.join()
  delta = jax.tree.map(lambda x: np.full(x.shape, 1e-4, np.float32), theta)
  seq, rounds = status["acked_seq"] + 1, []
  out.put(("ready", learner))
  go.wait()  # Every learner starts at once; the windows are told apart afterwards, by their times.
  while not status["done"]:
    if not finish.is_set():  # After the windows, the budget's rest goes as fast as it can.
      time.sleep(round_seconds)
    begin = time.time()
    try:
      reply = client.push(seq, delta, base_version=status["version"], tokens=INNER_STEPS * BATCH * SEQ_LEN,
                          local_steps=INNER_STEPS, compute_seconds=round_seconds)
      outcome = reply["status"]
      status = client.pull(-1)[0] if not reply["done"] else reply
    except Exception as error:  # pylint: disable=broad-except
      outcome = f"failed: {type(error).__name__}: {error}"
    seq += 1
    rounds.append((begin, time.time() - begin, outcome))
  out.put((learner, rounds))


def _attack(address: str, syncer_pid: int, seconds: float, windows: int, niceness: int, flood_rate: float, go,
            out) -> None:
  """Alternates `windows` undisturbed windows with as many of the compromised learner's attack loops,
  `seconds` each, at `niceness` (see the module doc), from `go`; reports each window's span and
  the syncer's CPU seconds and RSS (MB) at its ends, and the attack's volume."""
  os.nice(niceness)
  from decoupled_diloco.service import security  # pylint: disable=g-import-not-at-top
  credential = security.learner_credential(SECRET, ATTACKER)
  host = address.rsplit(":", 1)[0]
  data_port = attacks.ticket(address, attacks.push_header(ATTACKER, 8), credential)["port"]
  loops = ([lambda stop: attacks.reconnect_flood(host, data_port, stop, per_second=flood_rate / 4)] * 4 +
           [lambda stop: attacks.reconnect_flood(host, data_port, stop, hold_seconds=30)] * 4 +
           [lambda stop: attacks.slow_sender(address, data_port, credential, ATTACKER, stop)] * 2 +
           [lambda stop: attacks.stalled_push(address, credential, ATTACKER, stop, payload_bytes=64 << 10)] * 4 +
           [lambda stop: attacks.poison_headers(address, credential, ATTACKER, 0, stop, pause=0.01)] * 2)
  total = collections.Counter()
  out.put("ready")
  go.wait()

  def sample():
    return time.time(), _cpu_seconds(syncer_pid), common.status_kb("VmRSS", syncer_pid) / 1024

  edges = [sample()]  # One sample where each window ends and the next begins.
  for _ in range(windows):
    time.sleep(seconds)
    edges.append(sample())
    for result in attacks.run_for(seconds, loops):
      total.update(result)
    edges.append(sample())
  spans = {"undisturbed": list(zip(edges[0::2], edges[1::2])), "attack": list(zip(edges[1::2], edges[2::2]))}
  out.put({"spans": spans, "volume": dict(total), "cpu_seconds": time.process_time()})


def _next(results, children, seconds: float):
  """The next item `children` put on `results`; raises at once, naming it, if one of them died instead.

  Why: a crashed child puts nothing, and waiting out `seconds` (up to 10 minutes) for it hid the crash.
  """
  deadline = time.monotonic() + seconds
  while True:
    try:
      return results.get(timeout=0.5)
    except queue_lib.Empty:
      dead = [child for child in children if child.exitcode not in (None, 0)]
      if dead:
        raise RuntimeError(f"{dead[0].name} exited with status {dead[0].exitcode}; its output is above") from None
      if time.monotonic() > deadline:
        raise TimeoutError(f"nothing from {[child.name for child in children]} in {seconds:.0f} s") from None


def _cpu_seconds(pid: int) -> float:
  """A process's user + system CPU seconds so far (Linux /proc)."""
  with open(f"/proc/{pid}/stat", encoding="ascii") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _phase(begin: float, spans: dict) -> str:
  """The kind of window a round began in ('undisturbed', 'attack'), or 'other' (before or after them all)."""
  return next((kind for kind, windows in spans.items() for (start, *_), (end, *_) in windows if start <= begin < end),
              "other")


def _fraction(rounds, phase: str, spans: dict) -> float:
  """A learner's blocked seconds in rounds begun in `phase`'s windows over those windows' wall-clock."""
  blocked = sum(seconds for begin, seconds, _ in rounds if _phase(begin, spans) == phase)
  return blocked / sum(end[0] - start[0] for start, end in spans[phase])


def main():
  """One syncer, undisturbed and attack windows alternating; prints the JSON line."""
  parser = common.parser(__doc__)
  parser.add_argument("--phase_seconds", type=float, default=45.0, help="Length of each phase, its windows together.")
  parser.add_argument("--windows", type=int, default=3, help="Windows of each phase; they alternate.")
  parser.add_argument("--round_seconds", type=float, default=1.0, help="An honest learner's compute per round.")
  parser.add_argument("--flood_rate", type=float, default=2400.0, help="Connect-and-close attempts a second.")
  parser.add_argument("--attacker_nice", type=int, default=10, help="The attackers' niceness above the syncer's.")
  args = parser.parse_args()
  rounds_per_learner = 2 * args.phase_seconds / args.round_seconds
  outer_steps = int(1.2 * rounds_per_learner * len(HONEST) / 5) + 2  # The honest pushes nearly spend it.
  context = multiprocessing.get_context("spawn")
  with tempfile.TemporaryDirectory() as workdir:
    cluster = LocalCluster("configs/demo.py", workdir, [*OVERRIDES, f"--config.outer_steps={outer_steps}"], 5,
                           env=dict(os.environ, DD_SYNCER_TOKEN=SECRET))
    try:
      address = cluster.start_syncer()
      pid = cluster.processes["syncer"].pid
      out, attack_out, go, finish = context.Queue(), context.Queue(), context.Event(), context.Event()
      honest = [context.Process(target=_honest, args=(address, m, go, finish, args.round_seconds, out)) for m in HONEST]
      for process in honest:
        process.start()
      for _ in HONEST:
        assert _next(out, honest, 300)[0] == "ready"
      attacker = context.Process(
          target=_attack, args=(address, pid, args.phase_seconds / args.windows, args.windows, args.attacker_nice,
                                args.flood_rate, go, attack_out))
      attacker.start()
      assert _next(attack_out, [attacker], 300) == "ready"
      go.set()
      rss_peak = 0.0
      while attacker.is_alive() and attack_out.empty():
        rss_peak = max(rss_peak, common.status_kb("VmRSS", pid) / 1024)
        time.sleep(0.5)
      attack = _next(attack_out, [attacker], 600)
      finish.set()
      learners = dict(_next(out, honest, 600) for _ in HONEST)
      for process in [*honest, attacker]:
        process.join(timeout=60)
      cluster.processes["syncer"].wait(timeout=300)
      summary = next(
          r for r in metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl")) if r["kind"] == "summary")
    finally:
      cluster.stop()
  spans = attack["spans"]
  attacked = [s for rounds in learners.values() for begin, s, _ in rounds if _phase(begin, spans) == "attack"]
  blocked = {phase: float(np.mean([_fraction(r, phase, spans) for r in learners.values()])) for phase in spans}
  failed = [o for rounds in learners.values() for *_, o in rounds if o not in ("applied", "dropped", "late")]
  for outcome in failed[:5]:
    print("honest exchange failed:", outcome)
  exchanges = {
      phase: sum(_phase(b, spans) == phase for rounds in learners.values() for b, *_ in rounds) for phase in spans}
  cpu_per_exchange = {
      phase: sum(end[1] - start[1] for start, end in windows) / max(1, exchanges[phase])
      for phase, windows in spans.items()}
  print(f"syncer CPU s per honest exchange: undisturbed {cpu_per_exchange['undisturbed']:.4f} "
        f"({exchanges['undisturbed']} exchanges), under attack {cpu_per_exchange['attack']:.4f} "
        f"({exchanges['attack']}); the attackers' CPU {attack['cpu_seconds']:.2f} s; windows (s): " +
        ", ".join(f"{kind[0]} {end[0] - start[0]:.1f}" for pair in zip(spans["undisturbed"], spans["attack"])
                  for kind, (start, end) in zip(("undisturbed", "attack"), pair)))
  p50, p99 = (round(float(np.percentile(attacked, q)), 4) for q in (50, 99))
  rss_start = spans["attack"][0][0][2]
  common.emit_keys(
      {
          "honest_push_p99_seconds": p99, "blocked_ratio": round(blocked["attack"] / blocked["undisturbed"], 3),
          "honest_refused": len(failed), "refused": summary["refused_calls"], "syncer_rss_growth_mb": round(
              spans["attack"][-1][1][2] - rss_start, 1), "honest_push_p50_seconds": p50, "syncer_cpu_ratio": round(
                  cpu_per_exchange["attack"] / cpu_per_exchange["undisturbed"], 3),
          "blocked_fraction_undisturbed": round(blocked["undisturbed"], 4), "blocked_fraction_under_attack": round(
              blocked["attack"], 4), "honest_exchanges": sum(len(r) for r in learners.values()),
          "attack_attempts": attack["volume"], "syncer_rss_peak_growth_mb": round(
              max(rss_peak, rss_start) - rss_start, 1), "phase_seconds": args.phase_seconds, "windows":
                  args.windows, "round_seconds": args.round_seconds, "run_done": summary["done"]},
      ("honest_push_p99_seconds", "blocked_ratio", "honest_refused", "refused", "syncer_rss_growth_mb"))


if __name__ == "__main__":
  main()
