"""The networked runtime: the syncer as a gRPC service, each learner group its own process.

  wire.py        bytes on the wire: msgpack headers, self-describing array payloads, chunks
  wal.py         the syncer's write-ahead log (an ack means the push is on disk)
  core.py        SyncerCore: the state machine (exactly-once pushes, merges, replay, budget)
  durable.py     its write-ahead log + verified checkpoints, fail-stop on a failed append
  admission.py   known learner, current incarnation, float32 arrays (with limits.py: bounded headers)
  membership.py  start barrier, leases and the quorum they lower
  pullcache.py   Θ for joins and pulls in the downlink format, encoded once per fragment version
  security.py    run secret (env/file), per-learner credentials derived from it, TLS credentials
  limits.py      upper bounds on push headers (tokens, local_steps, seq)
  server.py      gRPC methods Join/Pull/Push/Heartbeat/PushTicket/PullTicket, refusals as gRPC statuses, bulk slots
  datachannel.py pushes and pulls over a ticketed TCP socket (separate pools, transfer deadlines)
  link.py        per-learner link shaping in real time (token bucket at the sender, latency)
  group.py       multi-process learner groups: the leader's exchange shared leaf by leaf
  client.py      a learner's calls with retries and backoff
  settings.py    config.service as a typed, validated group
  runconfig.py   what both processes derive from the config (address file, budget, payload bound)
  syncer_main.py / learner_main.py   the two processes (experiments.train --role=...)
"""
