"""A seeded schedule of SIGKILLs and restarts for a local service run (launch_local --chaos_seed, the chaos benchmark).

Why seeded: a fault test or benchmark that kills processes must be reproducible in which
victim dies when, so a failure it finds can be replayed; the clock still decides when a
kill is due, since the processes it kills run in real time.
"""

import random

from absl import logging


class Chaos:
  """A seeded schedule: every `every` seconds SIGKILL one process that has been up `min_uptime`
  seconds, restart it `delay` s later; at most `max_kills` kills (0 = no limit).

  `plan`: the kinds of the successive victims ('learner' or 'syncer'), e.g. to be sure a
  benchmark kills both; with a plan, the kills are the plan's (`include_syncer` and
  `max_kills` follow from it) and which learner dies is still the seeded choice.
  """

  def __init__(self, seed: int, every: float, delay: float, include_syncer: bool, min_uptime: float = 0.0,
               max_kills: int = 0, plan: tuple[str, ...] = ()):
    self.rng, self.every, self.delay, self.plan = random.Random(seed), every, delay, tuple(plan)
    self.include_syncer = include_syncer or "syncer" in self.plan
    self.min_uptime, self.max_kills = min_uptime, len(self.plan) or max_kills
    self.next_kill: float | None = None
    self.down: dict[str, float] = {}  # name -> when to restart it
    self.abandoned: set[str] = set()  # Killed, and not restarted because the run ended meanwhile.
    self.events: list[tuple[float, str, str]] = []

  def step(self, cluster, now: float) -> None:
    """Restarts what is due in `cluster` (a launch_local.LocalCluster), then kills the next victim if it is time."""
    self.next_kill = self.next_kill or now + self.every
    if cluster.processes["syncer"].poll() is not None and "syncer" not in self.down:  # The run is over.
      self.abandoned.update(self.down)
      self.down.clear()
      return
    for name, when in list(self.down.items()):
      if now >= when:
        del self.down[name]
        cluster.restart(name)
        self.events.append((now, "restart", name))
    learners_running = any(not n.startswith("syncer") for n in [*cluster.running(), *self.down])
    kills = sum(event == "kill" for _, event, _ in self.events)
    if self.max_kills and kills >= self.max_kills:
      return  # The kill budget is spent.
    if now < self.next_kill or cluster.processes["syncer"].poll() is not None or not learners_running:
      return  # Too early, or the run is over (the learners exited after hearing so).
    self.next_kill = now + self.every
    candidates = [n for n in sorted(cluster.running()) if not n.startswith("syncer") or self.include_syncer]
    candidates = [n for n in candidates if n not in self.down and now - cluster.started_at[n] >= self.min_uptime]
    if self.plan:
      candidates = [n for n in candidates if n.startswith("syncer") == (self.plan[kills] == "syncer")]
    if candidates:
      victim = self.rng.choice(candidates)
      cluster.kill(victim)
      self.down[victim] = now + self.delay
      self.events.append((now, "kill", victim))
      logging.info("chaos: killed %s, restarting it in %.1fs", victim, self.delay)
