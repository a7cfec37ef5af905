"""The networked runtime: the syncer as a gRPC service, each learner group its own process.

One module per concept (wire format, write-ahead log, core state machine, server, data
channel, client, processes); docs/service.md lists them.
"""
