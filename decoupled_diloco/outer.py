"""Outer optimization: pseudo-gradients and the optimizer the syncer applies to them.

A pseudo-gradient is Δ = Θ − θ (global minus local): it points uphill like a gradient,
so any optax transformation can be the outer optimizer. SGD with lr 1 and no momentum
turns Θ into the (weighted) mean of the learners' parameters; the DiLoCo default is
Nesterov SGD with lr 0.7 and momentum 0.9, which matches PyTorch's Nesterov SGD.
"""

import jax
import optax

from decoupled_diloco.errors import ConfigError


def pseudo_gradient(global_params, local_params):
  """Δ = Θ − θ: what the learner's inner steps moved, in gradient orientation."""
  return jax.tree.map(lambda g, l: g - l, global_params, local_params)


def _sgd(cfg):
  momentum = cfg.momentum or None  # optax treats momentum=None as plain SGD.
  return optax.sgd(cfg.lr, momentum=momentum, nesterov=bool(cfg.nesterov and momentum))


def _adam(cfg):
  return optax.adam(cfg.lr, b1=cfg.momentum or 0.9)


OUTER_OPTIMIZERS = {"sgd": _sgd, "adam": _adam}


def outer_optimizer(outer_cfg) -> optax.GradientTransformation:
  """The configured outer optimizer; code that needs another can pass any optax transform."""
  if outer_cfg.optimizer not in OUTER_OPTIMIZERS:
    raise ConfigError(f"outer.optimizer={outer_cfg.optimizer!r} is unknown: use one of {sorted(OUTER_OPTIMIZERS)}")
  if outer_cfg.lr <= 0:
    raise ConfigError(f"outer.lr={outer_cfg.lr} must be > 0: set --config.outer.lr to a positive value")
  return OUTER_OPTIMIZERS[outer_cfg.optimizer](outer_cfg)


def outer_step(optimizer: optax.GradientTransformation, params, opt_state, delta):
  """Θ ← OuterOpt(Θ, Δ): one optimizer step with the merged pseudo-gradient as gradient."""
  updates, opt_state = optimizer.update(delta, opt_state, params)
  return optax.apply_updates(params, updates), opt_state
