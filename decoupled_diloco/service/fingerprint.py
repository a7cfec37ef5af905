"""What a learner's config must share with the syncer's, compared once, at Join.

Why: a learner started from another config than the syncer's failed late and obscurely:
another `model.d_model` died in a JAX traceback as Θ landed, another
`streaming.num_fragments` in an IndexError, another `compression.format` trained to the end
with every push refused and exit status 0. So every Join carries the learner's values of
FIELDS (each as JSON text: a header holds short maps and lists only), the syncer compares them
with its own, and a learner that differs is refused (FAILED_PRECONDITION, counted `mismatch`)
with one line naming the field; its process prints that line and exits 2 (learner_main).

FIELDS are what both sides consume: the mode and the round (`inner_steps`, `policy.kind`: the
push bounds), the parameter shapes, each learner's batch (tokens per step), the fragments and
their layout over syncer shards, the push payload's format, and the outer settings (the run
both sides think they are in). What one side alone uses (a learner's remat, its data pipeline,
the downlink format, which is self-describing) may differ. A Join without a fingerprint (an
operator's tool, a test's client) is not compared.
"""

import json

FIELDS = ("mode", "inner_steps", "policy.kind", "model.vocab_size", "model.seq_len", "model.d_model",
          "model.num_layers", "model.num_heads", "model.num_kv_heads", "model.d_ff", "model.mlp", "model.position",
          "model.tie_embeddings", "learners.batch_size", "streaming.num_fragments", "streaming.strategy",
          "service.shards", "compression.format", "compression.block_size", "compression.topk_fraction",
          "outer.optimizer", "outer.lr", "outer.momentum", "outer.nesterov", "outer.buffer_size")


class Mismatch(ValueError):
  """A learner's config differs from the syncer's in a field both must agree on; nothing was changed."""


def field_value(values: dict, field: str):
  """The value of dotted `field` ('model.d_model') in a config's `to_dict()`, or None where it has none.

  Why here: Join and resume (service/resume.py) both compare configs field by field, one of them
  saved as JSON in a checkpoint, where a field a newer config added is simply absent.
  """
  for key in field.split("."):
    values = values.get(key) if isinstance(values, dict) else None
  return values


def of(config) -> dict[str, str]:
  """{field: its value as JSON text} of a resolved config (a ConfigDict, or its `to_dict()`)."""
  values = config.to_dict() if hasattr(config, "to_dict") else config
  fingerprint = {}
  for field in FIELDS:
    value = field_value(values, field)
    fingerprint[field] = json.dumps(list(value) if isinstance(value, tuple) else value)
  return fingerprint


def check(syncer: dict[str, str] | None, learner: dict, learner_id: int) -> None:
  """Raises Mismatch naming the first of FIELDS whose learner value differs from the syncer's.

  `syncer`: None when the syncer has no config to compare with (an in-process core of the tests).
  """
  if syncer is None or not learner:
    return
  for field, mine in syncer.items():
    theirs = learner.get(field)
    if theirs != mine:
      raise Mismatch(f"learner {learner_id}'s config differs from the syncer's: {field} is {theirs} there but {mine} "
                     "at the syncer: start every process of the run with the same config and overrides")
