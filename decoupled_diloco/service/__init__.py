"""The networked runtime: the syncer as a gRPC service, each learner group its own process.

  wire.py        bytes on the wire: msgpack headers, self-describing array payloads, chunks
  wal.py         the syncer's write-ahead log (an ack means the push is on disk)
  core.py        SyncerCore: exactly-once pushes, checkpoints + log replay, leases, budget
  security.py    run secret (env/file), per-learner credentials derived from it, TLS credentials
  limits.py      upper bounds on push headers (tokens, local_steps, seq)
  server.py      gRPC methods Join/Pull/Push/Heartbeat/PushTicket/PullTicket, refusals as gRPC statuses, bulk slots
  datachannel.py pushes and pulls over a ticketed TCP socket (separate pools, transfer deadlines)
  link.py        per-learner link shaping in real time (token bucket at the sender, latency)
  group.py       multi-process learner groups: the leader's exchange shared leaf by leaf
  client.py      a learner's calls with retries and backoff
  runconfig.py   checks of config.service and what both processes derive from the config
  syncer_main.py / learner_main.py   the two processes (experiments.train --role=...)
"""
